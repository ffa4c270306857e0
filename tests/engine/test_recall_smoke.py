"""`kvtier eval recall` smoke test on the real SmolLM2: prompts hold their keys, and with a budget at
least the context every selector answers exactly as dense attention does."""

from __future__ import annotations

import random

from kvtier.eval.recall import build_prompt, run_fidelity, run_recall, summarize, to_markdown


def test_prompts_are_whole_pages_and_hold_every_key(smol_parts):
    _, tok = smol_parts
    for hay in ("repeated", "varied"):
        ids, keys = build_prompt(tok, 500, 0.3, 3, hay, random.Random(0), 16)
        text = tok.decode(ids)
        assert len(ids) % 16 == 0 and len(ids) <= 500 and len(keys) == 3
        assert all(f"The pass key is {k}." in text for k in keys)


def test_chat_prompts_wrap_haystack_and_question_in_the_template(smol_parts):
    _, tok = smol_parts
    ids, keys = build_prompt(tok, 500, 0.6, 1, "repeated", random.Random(1), 16, chat=True)
    text = tok.decode(ids)
    assert len(ids) % 16 == 0 and len(ids) <= 500
    user_turn = text.index("<|im_start|>user\n")
    assert user_turn < text.index("The pass key is " + keys[0]) < text.index("What is the pass key?")
    assert text.endswith("<|im_start|>assistant\nThe pass key is")


def test_budget_at_least_context_answers_as_dense(smol_parts):
    model, tok = smol_parts
    trials = run_recall(model, tok, [512], [0.5], trials=1, needles=1, haystack="varied", budget=1024,
                        selectors=["quest"])
    answers = {t.method: t.answer for t in trials}
    assert answers["quest"] == answers["dense"]
    assert "dense" in to_markdown(summarize(trials))


def test_small_budget_reports_fidelity(smol_parts):
    model, tok = smol_parts
    fid = run_fidelity(model, tok.encode("The quick brown fox jumps over the lazy dog. " * 40)[:260], 3,
                       budget=128, selectors=["quest"], window=16)
    assert fid[0].mean_kl >= 0 and fid[0].mass is not None and 0 < fid[0].mass <= 1


def test_8bit_summaries_from_the_pool_equal_the_ones_written(smol_parts):
    """A "<selector>/8" method's 8-bit summaries, recomputed from the pool after a prefill its
    backend did not run, equal those an 8-bit backend writes as it prefills (codes independent of
    how rows arrive); the selector answers with them."""
    import torch

    from kvtier.eval.recall import _Runner
    model, tok = smol_parts
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 30)[:301]
    synced = _Runner(model, 320, 128, ["quest", "quest/8"], 4, 16, 16, record=False)
    synced.prefill(ids)
    written = _Runner(model, 320, 128, ["quest/8"], 4, 16, 16, record=False)
    written.prefill(ids)
    a, b = synced.summaries[8], written.summaries[8]
    for name in ("kmin", "kmax", "kexp", "count"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert int(a.count[0, :19].sum()) == 301 and bool((a.kexp[0, :19] != a.kexp[0, 0, 0]).any())
