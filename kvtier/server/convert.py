"""What every API shares on the way in: chat-template rendering, the built-in
Hermes tool prompt, tool_choice / response_format -> grammar, sampling params,
and the context-length check.

Messages are normalised to the Hugging Face chat-template shape first:
    {"role", "content": str, "tool_calls": [{"id", "type", "function": {"name",
     "arguments": str}}], "tool_call_id", "reasoning_content"}
and each API module owns its own conversion into that shape.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from kvtier.config import ServerConfig
from kvtier.engine.request import ContextOverflowError, PinnedOverBudgetError, Request, SamplingParams
from kvtier.server.errors import APIError, bad_request, overflow_error_from
from kvtier.server.generation import Prepared
from kvtier.server.spans import pinned_spans

# The tool prompt used when a model's chat template has no tool support: the
# Hermes / Qwen2.5 format, which small instruct models follow reasonably well.
HERMES_TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n"
    "</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# How a mid-conversation system turn reads when the template only takes system text first.
SYSTEM_OPEN, SYSTEM_CLOSE = "<system>\n", "\n</system>"


@dataclass(frozen=True)
class ToolChoice:
    """mode: none | auto | required | named (then `name` is the function);
    parallel: more than one call per turn is allowed."""

    mode: str = "auto"
    name: str | None = None
    parallel: bool = True


@dataclass(frozen=True)
class OutputFormat:
    """kind: text | json_object | json_schema (then `schema`)."""

    kind: str = "text"
    schema: dict | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def tool_def(name: str, description: str | None, parameters: dict | None) -> dict:
    """One tool in the OpenAI shape that chat templates and the grammar expect."""
    return {"type": "function", "function": {
        "name": name, "description": description or "",
        "parameters": parameters if parameters is not None else {"type": "object", "properties": {}}}}


# Hermes call framing (Qwen2.5 / Qwen3 chat templates): call_prefix(name), arguments, CALL_SUFFIX.
CALL_TRIGGER = "<tool_call>"
CALL_SUFFIX = "}\n</tool_call>"
# How a bare JSON call begins (tool_call_tag constrains what follows to a call of an offered tool).
BARE_CALL_TRIGGER = '{"name": "'


def call_prefix(name: str) -> str:
    """What a Hermes call is written as up to its arguments; the grammar forces exactly this."""
    return f'{CALL_TRIGGER}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


def format_tool_call(name: str, arguments: str) -> str:
    """A tool call exactly as the model wrote it under the tool grammar (so history re-renders
    to the same tokens): fixed framing around the arguments text as generated."""
    return call_prefix(name) + arguments + CALL_SUFFIX


def tool_call_tag(tools: list[dict], choice: ToolChoice) -> dict:
    """xgrammar structural tag for Hermes calls of the offered `tools` (the `tool_def` shape),
    compiled by engine/grammar.py `GrammarCompilerCache.structural_tag`. The name and framing
    are forced literally, as `format_tool_call` writes them back, so a call re-renders byte for
    byte; the arguments follow the tool's JSON schema:

        <tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>

    required / named: one or more calls (one unless parallel), newline-separated, no other text;
    auto: free text, and whatever follows `<tool_call>` must be a well-formed call; so must a bare
    JSON call (`{"name": NAME, "arguments": ARGS}`, what Qwen2.5-Coder 0.5B/1.5B write), which
    bare_calls.py takes as a call when it is the whole reply.
    """
    specs = [(t["function"]["name"], t["function"]["parameters"]) for t in tools
             if choice.mode != "named" or t["function"]["name"] == choice.name]
    if not specs:
        raise ValueError(f"no tool to call for tool_choice {choice.mode!r}")
    tags = [_args_tag(call_prefix(name), CALL_SUFFIX, params) for name, params in specs]
    if choice.mode == "auto":
        bare = [_args_tag(_bare_call_prefix(name), "}", params) for name, params in specs]
        fmt = {"type": "triggered_tags", "triggers": [CALL_TRIGGER, BARE_CALL_TRIGGER], "tags": tags + bare,
               "at_least_one": False, "stop_after_first": not choice.parallel}
    else:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n",
               "at_least_one": True, "stop_after_first": not choice.parallel}
    return {"type": "structural_tag", "format": fmt}


def _bare_call_prefix(name: str) -> str:
    return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


def _args_tag(begin: str, end: str, params: dict) -> dict:
    return {"type": "tag", "begin": begin, "end": end, "content": {"type": "json_schema", "json_schema": params}}


def text_of(content: Any, where: str) -> str:
    """Flatten str | [{type: text|input_text|output_text, text}] into one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        kind = part.get("type", "text") if isinstance(part, dict) else None
        if kind in ("text", "input_text", "output_text") and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind in ("image_url", "image", "input_image", "input_audio", "document", "input_file"):
            raise bad_request(f"{where}: {kind} content is not supported by this text-only model",
                              param=where)
        else:
            raise bad_request(f"{where}: unsupported content part {kind!r}", param=where)
    return "".join(parts)


def _hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Rewrite tool use into plain text turns for templates that know nothing of tools."""
    out: list[dict] = []
    for m in messages:
        role = m["role"]
        if role == "assistant" and m.get("tool_calls"):
            calls = [format_tool_call(c["function"]["name"], c["function"]["arguments"])
                     for c in m["tool_calls"]]
            content = m.get("content") or ""
            text = (content + "\n" if content else "") + "\n".join(calls)
            out.append({**_without(m, "tool_calls"), "content": text})
        elif role == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        prompt = HERMES_TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" + prompt).lstrip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


def _fold_reasoning(messages: list[dict]) -> list[dict]:
    """Templates that drop `reasoning_content` get it back inline, as the model wrote it."""
    out = []
    for m in messages:
        r = m.get("reasoning_content")
        if m["role"] == "assistant" and r:
            m = {**_without(m, "reasoning_content"),
                 "content": f"{THINK_OPEN}{r}{THINK_CLOSE}{m.get('content') or ''}"}
        out.append(m)
    return out


def _late_system_texts(messages: list[dict]) -> list[str]:
    return [m.get("content") or "" for i, m in enumerate(messages) if i > 0 and m["role"] == "system"]


def fold_late_system(messages: list[dict]) -> list[dict]:
    """System turns after the first message, for templates that refuse or drop them.

    Each becomes `<system>TEXT</system>` user text, merged with a neighbouring plain user turn
    (the previous one if it is plain user text, else the next), so roles still alternate and the
    turns before it render as they did (the prefix cache keeps them). A leading system message
    stays where it is.
    """
    out: list[dict] = []
    for i, m in enumerate(messages):
        if i > 0 and m["role"] == "system":
            m = {"role": "user", "content": f"{SYSTEM_OPEN}{m.get('content') or ''}{SYSTEM_CLOSE}"}
        if m["role"] == "user" and out and _plain_user(out[-1]) and _plain_user(m):
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + m["content"]}
        else:
            out.append(m)
    return out


def _plain_user(m: dict) -> bool:
    return m["role"] == "user" and isinstance(m.get("content"), str) and set(m) <= {"role", "content"}


def render_prompt(tokenizer, messages: list[dict], tools: list[dict] | None,
                  template_kwargs: dict | None = None) -> str:
    """Render with the model's own chat template (Hermes tool prompt if it has no tool support).

    System turns may come anywhere (Anthropic clients send them mid-conversation): they render
    in place, as system turns, when the template accepts them; when it raises or leaves their
    text out, they are folded into user turns (`fold_late_system`) and rendered again.
    """
    template = tokenizer.chat_template or ""
    native_tools = bool(tokenizer.has_tool_support)
    msgs = messages if native_tools else _hermes_messages(messages, tools)
    if "reasoning_content" not in template:
        msgs = _fold_reasoning(msgs)
    for m in msgs:
        m.setdefault("content", "")
        if m["content"] is None:
            m["content"] = ""
    late = _late_system_texts(msgs)
    try:
        text = _apply_template(tokenizer, msgs, tools if native_tools and tools else None, template_kwargs)
        if all(t.strip() in text for t in late):
            return text
    except APIError:
        if not late:
            raise
    return _apply_template(tokenizer, fold_late_system(msgs), tools if native_tools and tools else None,
                           template_kwargs)


def _apply_template(tokenizer, msgs: list[dict], tools: list[dict] | None, template_kwargs: dict | None) -> str:
    try:
        return tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True,
                                             **dict(template_kwargs or {}))
    except APIError:
        raise
    except Exception as e:  # template errors (role order, missing fields) are the client's
        raise bad_request(f"the chat template could not render these messages: {e}",
                          param="messages") from e


def starts_in_reasoning(prompt_text: str) -> bool:
    """True when the generation prompt leaves a <think> block open (e.g. Qwen3 thinking)."""
    tail = prompt_text.rstrip()
    return tail.endswith(THINK_OPEN)


def resolve_max_tokens(requested: int | None, prompt_len: int, limit: int, clamp: bool = False) -> int:
    """The completion budget; 400 (naming the lengths) when prompt + request exceed the context.

    clamp: a request past the context is cut to the rest of it instead (the prompt itself must
    still fit); for APIs whose clients send one fixed cap whatever the model (Claude Code: 32000).
    """
    if requested is None or (clamp and prompt_len < limit):
        if prompt_len >= limit:
            raise overflow_error_from(ContextOverflowError(prompt_len, 1, limit))
        return limit - prompt_len if requested is None else min(requested, limit - prompt_len)
    if prompt_len + requested > limit:
        raise overflow_error_from(ContextOverflowError(prompt_len, requested, limit))
    return requested


def stop_list(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else list(stop)
    return tuple(s for s in items if s)


def sampling_params(body: Any, max_tokens: int, stop: tuple[str, ...], defaults: Any = None) -> SamplingParams:
    """Build SamplingParams from the shared knobs; a ValueError there is the client's 400.

    defaults: the server's ServerConfig (its default_* knobs fill what the request leaves out).
    """
    g = body.__dict__.get
    d = defaults if defaults is not None else _OPENAI_DEFAULTS
    top_k = g("top_k")
    try:
        return SamplingParams(
            temperature=d.default_temperature if g("temperature") is None else g("temperature"),
            top_p=d.default_top_p if g("top_p") is None else g("top_p"),
            top_k=d.default_top_k if top_k is None or top_k < 0 else top_k,
            min_p=d.default_min_p if g("min_p") is None else g("min_p"),
            repetition_penalty=g("repetition_penalty") or 1.0,
            presence_penalty=g("presence_penalty") or 0.0,
            frequency_penalty=g("frequency_penalty") or 0.0,
            seed=g("seed"), max_tokens=max_tokens, stop=stop, ignore_eos=bool(g("ignore_eos")))
    except ValueError as e:
        raise bad_request(str(e)) from e


_OPENAI_DEFAULTS = ServerConfig()  # temperature 1, top_p 1, no top_k / min_p


def check_tool_choice(choice: ToolChoice, tools: list[dict] | None) -> None:
    names = [t["function"]["name"] for t in tools or []]
    if choice.mode in ("required", "named") and not names:
        raise bad_request(f"tool_choice {choice.mode!r} needs at least one tool", param="tool_choice")
    if choice.mode == "named" and choice.name not in names:
        raise bad_request(f"tool_choice names the function {choice.name!r}, which is not among the "
                          f"tools ({', '.join(names)})", param="tool_choice")


def prepare(ctx, request_id: str, messages: list[dict], tools: list[dict] | None, choice: ToolChoice,
            fmt: OutputFormat, body: Any, max_tokens: int | None, stop: tuple[str, ...],
            template_kwargs: dict | None = None, prefill: str = "", clamp_max_tokens: bool = False) -> Prepared:
    """The shared tail of every API's conversion: render, encode, budget, grammar.

    `prefill` continues a trailing assistant turn (Anthropic-style) verbatim; `clamp_max_tokens`
    cuts a budget past the context to what is left (see `resolve_max_tokens`).
    """
    check_tool_choice(choice, tools)
    offered = tools if choice.mode != "none" else None
    # Earlier replies the client sends back unedited keep the token ids the model sampled.
    prompt = ctx.outputs.render(ctx.tokenizer, messages,
                                lambda msgs: render_prompt(ctx.tokenizer, msgs, offered, template_kwargs) + prefill)
    text, ids = prompt.text, prompt.token_ids
    budget = resolve_max_tokens(max_tokens, len(ids), ctx.max_model_len, clamp=clamp_max_tokens)
    spans = _pinned(ctx, messages, offered, template_kwargs, ids, budget)
    params = sampling_params(body, budget, stop, ctx.config)
    grammar = ctx.grammars.for_request(offered, choice, fmt)
    return Prepared(request=Request(request_id, ids, params, grammar=grammar, pinned_spans=spans),
                    tools=bool(offered), starts_in_reasoning=starts_in_reasoning(text), prompt_text=text,
                    tool_names=tuple(t["function"]["name"] for t in offered or []), memory=ctx.outputs,
                    prefill=prefill, progress_log_s=ctx.config.progress_log_s)


def _pinned(ctx, messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None,
            ids: list[int], max_tokens: int) -> tuple[tuple[int, int], ...]:
    """With retrieval attention on: the spans to pin (server/spans.py), refused with the context
    overflow's 400 when they cannot fit the budget; () otherwise, at no cost."""
    limits = ctx.pinned_budget
    if limits is None:
        return ()
    spans = pinned_spans(ctx.tokenizer, ctx.outputs, messages,
                         lambda msgs: render_prompt(ctx.tokenizer, msgs, tools, template_kwargs), ids)
    try:
        limits.check(spans, len(ids), max_tokens)
    except PinnedOverBudgetError as e:
        raise overflow_error_from(e) from e
    return spans


def prepare_raw(ctx, request_id: str, ids: list[int], body: Any, max_tokens: int | None,
                stop: tuple[str, ...]) -> Prepared:
    """A plain-completion prompt: no template, no tools, no reasoning parsing."""
    if not ids:
        raise bad_request("the prompt is empty", param="prompt")
    budget = resolve_max_tokens(max_tokens, len(ids), ctx.max_model_len)
    return Prepared(request=Request(request_id, ids, sampling_params(body, budget, stop, ctx.config)),
                    tools=False, starts_in_reasoning=False, reasoning=False,
                    progress_log_s=ctx.config.progress_log_s)


def thinking_kwargs(enabled: bool | None, extra: dict | None = None) -> dict:
    """Template switches for reasoning models (Qwen3: enable_thinking)."""
    kw = dict(extra or {})
    if enabled is not None:
        kw.setdefault("enable_thinking", enabled)
    return kw
