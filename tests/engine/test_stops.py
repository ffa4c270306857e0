"""StopChecker: chunking-independent stop-string matching with minimal hold-back."""

from __future__ import annotations

import random

import pytest

from kvtier.engine.stops import StopChecker


def reference(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Whole-text semantics: earliest start wins, then the shortest stop."""
    hits = [(text.find(s), len(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    start, _, stop = min(hits)
    return text[:start], stop


def run(chunks: list[str], stops: list[str]) -> tuple[str, str | None, list[str]]:
    sc = StopChecker(stops)
    out, emitted = [], []
    for c in chunks:
        text, matched = sc.feed(c)
        emitted.append(text)
        out.append(text)
        if matched is not None:
            return "".join(out), matched, emitted
    out.append(sc.flush())
    return "".join(out), None, emitted


def chunkings(text: str, rng: random.Random, n: int) -> list[list[str]]:
    ways = [[text], list(text)]
    for _ in range(n):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(5, len(text) - 1))))
        ways.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    return ways


CASES = [
    ("Hello world. END more", ["END"]),
    ("abc\n\nUser: hi", ["\n\nUser:", "\nUser"]),
    ("xabcd", ["bc", "abcd"]),
    ("xabcd", ["abcd", "bc"]),
    ("aaab", ["aab"]),
    ("nothing to see", ["zz", "qq"]),
    ("prefix ENDING never completes EN", ["END!"]),
    ("héllo wörld ☃ snow ☃☃ stop", ["☃☃", "wörld ☃ x"]),
    ("日本語のテキスト。終わり", ["終わり", "テキスト。終"]),
    ("ab", ["ab", "abc"]),
    ("abc", ["abc", "ab"]),
]


@pytest.mark.parametrize("text,stops", CASES)
def test_any_chunking_matches_whole_text(text: str, stops: list[str]) -> None:
    rng = random.Random(0)
    want = reference(text, stops)
    for chunks in chunkings(text, rng, 30):
        got, matched, _ = run(chunks, stops)
        assert (got, matched) == want, chunks


def test_random_texts_and_stops() -> None:
    rng = random.Random(1)
    alphabet = "ab c\né"
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 25)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 3))]
        want = reference(text, stops)
        for chunks in chunkings(text, rng, 4):
            got, matched, _ = run(chunks, stops)
            assert (got, matched) == want, (text, stops, chunks)


def test_holds_back_only_possible_prefixes() -> None:
    sc = StopChecker(["</s>", "STOP"])
    assert sc.feed("hello <") == ("hello ", None)
    assert sc.held_back == "<"
    assert sc.feed("/") == ("", None)
    assert sc.feed("x> S") == ("</x> ", None)  # no longer a prefix: released
    assert sc.feed("TO") == ("", None)
    assert sc.feed("P tail") == ("", "STOP")
    with pytest.raises(ValueError):
        sc.feed("more")


def test_split_stop_across_deltas_and_flush() -> None:
    sc = StopChecker(["###"])
    assert sc.feed("a#") == ("a", None)
    assert sc.feed("#") == ("", None)
    assert sc.flush() == "##"
    sc2 = StopChecker(["###"])
    assert sc2.feed("a#") == ("a", None)
    assert sc2.feed("#") == ("", None)
    assert sc2.feed("#b") == ("", "###")


def test_no_stops_passes_through_and_rejects_empty() -> None:
    sc = StopChecker([])
    assert sc.feed("abc") == ("abc", None)
    with pytest.raises(ValueError):
        StopChecker(["ok", ""])
