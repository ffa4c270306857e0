"""Anthropic Messages API: /v1/messages and /v1/messages/count_tokens.

Stream (anthropic-python dispatches on the `event:` line of every frame):
    message_start -> ping
    per block i = 0, 1, 2 …: content_block_start{index: i} -> content_block_delta* -> content_block_stop
    message_delta{stop_reason, usage} -> message_stop
Errors mid-stream are `event: error`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvtier.server.context import ServerContext, Ticket
from kvtier.server.convert import (OutputFormat, ToolChoice, new_id, prepare, render_prompt, text_of,
                                   thinking_kwargs, tool_def)
from kvtier.server.errors import (ANTHROPIC_ERROR_RESPONSES, ANTHROPIC_STREAMING_RESPONSES, Flavor, bad_request,
                                  internal_error_frame, sse_error_data)
from kvtier.server.generation import (Collected, Finished, Prepared, ProgressEvent, ReasoningDelta, TextDelta,
                                      ToolCallArgsDelta, ToolCallStart, run_events)
from kvtier.server.openai import finished_error, progress_json, respond
from kvtier.server.protocol import CountTokensRequest, MessagesRequest, _AnthropicBase
from kvtier.server.sse import sse_comment, sse_event

router = APIRouter()
# Thinking blocks must carry a signature; ours is a fixed marker (nothing is verified on the way back).
THINKING_SIGNATURE = "kvtier-local"


# ---- request -> engine ---------------------------------------------------------

def _block_text(content, where: str) -> str:
    if isinstance(content, list):
        return "\n".join(text_of([b], where) for b in content if b.get("type") == "text")
    return text_of(content, where)


def _user_blocks(blocks: list[dict], where: str) -> list[dict]:
    msgs, texts = [], []
    for j, b in enumerate(blocks):
        kind = b.get("type")
        if kind == "tool_result":
            content = _block_text(b.get("content") or "", f"{where}[{j}].content")
            msgs.append({"role": "tool", "tool_call_id": b.get("tool_use_id") or "",
                         "content": ("Error: " + content) if b.get("is_error") else content})
        else:
            texts.append(text_of([b], f"{where}[{j}]"))
    if texts:
        msgs.append({"role": "user", "content": "\n".join(texts)})
    return msgs


def _assistant_blocks(blocks: list[dict], where: str) -> dict:
    msg: dict = {"role": "assistant", "content": ""}
    for j, b in enumerate(blocks):
        kind = b.get("type")
        if kind == "text":
            msg["content"] += text_of([b], f"{where}[{j}]")
        elif kind == "thinking":
            msg["reasoning_content"] = msg.get("reasoning_content", "") + str(b.get("thinking", ""))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            if not isinstance(b.get("name"), str):
                raise bad_request(f"{where}[{j}]: tool_use needs a name", param=where)
            args = json.dumps(b.get("input") or {}, ensure_ascii=False)
            msg.setdefault("tool_calls", []).append(
                {"id": b.get("id") or new_id("toolu_"), "type": "function",
                 "function": {"name": b["name"], "arguments": args}})
        else:
            raise bad_request(f"{where}[{j}]: unsupported block type {kind!r}", param=where)
    return msg


def _messages(body: _AnthropicBase) -> tuple[list[dict], str]:
    """Normalised messages plus an assistant prefill (a trailing assistant turn continues)."""
    msgs: list[dict] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "\n".join(
            text_of([b], "system") for b in body.system)
        msgs.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        where = f"messages[{i}].content"
        if m.role == "system":  # mid-conversation system turns (Claude Code's beta): rendered in place
            msgs.append({"role": "system", "content": _block_text(m.content, where)})
        elif isinstance(m.content, str):
            msgs.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            msgs += _user_blocks(m.content, where)
        else:
            msgs.append(_assistant_blocks(m.content, where))
    prefill = ""
    if msgs and msgs[-1]["role"] == "assistant" and not msgs[-1].get("tool_calls"):
        prefill = msgs.pop()["content"]
    return msgs, prefill


def _tools(body: _AnthropicBase) -> list[dict] | None:
    return [tool_def(t.name, t.description, t.input_schema) for t in body.tools or []] or None


def _choice(body: _AnthropicBase, tools) -> ToolChoice:
    tc = body.tool_choice
    if tc is None:
        return ToolChoice("auto" if tools else "none")
    parallel = not tc.disable_parallel_tool_use
    if tc.type == "tool":
        if not tc.name:
            raise bad_request("tool_choice type 'tool' needs a name", param="tool_choice")
        return ToolChoice("named", tc.name, parallel=parallel)
    return ToolChoice({"any": "required"}.get(tc.type, tc.type), parallel=parallel)


def _thinking(body: _AnthropicBase) -> dict:
    th = body.thinking
    return thinking_kwargs(None if th is None else th.type != "disabled")


def messages_to_prepared(ctx: ServerContext, body: MessagesRequest) -> Prepared:
    """The one function from an Anthropic Messages request to an engine request."""
    msgs, prefill = _messages(body)
    tools = _tools(body)
    # max_tokens is a cap: clients send one per model family (Claude Code: 32000), past a local context.
    return prepare(ctx, new_id("msg_"), msgs, tools, _choice(body, tools), OutputFormat(), body,
                   body.max_tokens, tuple(s for s in body.stop_sequences or () if s), _thinking(body),
                   prefill=prefill, clamp_max_tokens=True)


# ---- engine -> response ------------------------------------------------------------

def usage_json(u) -> dict:
    """Anthropic counts cache reads apart: input_tokens excludes them."""
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


def stop_reason(fin: Finished, body: MessagesRequest) -> tuple[str, str | None]:
    if fin.finish_reason == "tool_calls":
        return "tool_use", None
    if fin.finish_reason == "length":
        return "max_tokens", None
    if isinstance(fin.stop_reason, str) and fin.stop_reason in (body.stop_sequences or ()):
        return "stop_sequence", fin.stop_reason
    return "end_turn", None


def tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


class BlockWriter:
    """Parser events -> content blocks with sequential indices."""

    def __init__(self):
        self.index = -1
        self.kind: str | None = None
        self.tool_index: dict[int, int] = {}

    def _start(self, kind: str, block: dict) -> list[str]:
        frames = self.stop()
        self.index += 1
        self.kind = kind
        frames.append(sse_event("content_block_start",
                                {"type": "content_block_start", "index": self.index, "content_block": block}))
        return frames

    def _delta(self, delta: dict) -> str:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def stop(self) -> list[str]:
        if self.kind is None:
            return []
        frames = []
        if self.kind == "thinking":
            frames.append(self._delta({"type": "signature_delta", "signature": THINKING_SIGNATURE}))
        frames.append(sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.kind = None
        return frames

    def feed(self, ev) -> list[str]:
        frames: list[str] = []
        if isinstance(ev, TextDelta):
            if self.kind != "text":
                frames += self._start("text", {"type": "text", "text": ""})
            frames.append(self._delta({"type": "text_delta", "text": ev.text}))
        elif isinstance(ev, ReasoningDelta):
            if self.kind != "thinking":
                frames += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            frames.append(self._delta({"type": "thinking_delta", "thinking": ev.text}))
        elif isinstance(ev, ToolCallStart):
            frames += self._start("tool_use", {"type": "tool_use", "id": _tool_id(ev.id), "name": ev.name,
                                               "input": {}})
        elif isinstance(ev, ToolCallArgsDelta) and self.kind == "tool_use" and ev.text:
            frames.append(self._delta({"type": "input_json_delta", "partial_json": ev.text}))
        return frames


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


async def messages_stream(ctx: ServerContext, prep: Prepared, body: MessagesRequest,
                          ticket: Ticket) -> AsyncIterator[str]:
    mid = prep.request.request_id
    start_usage = {"input_tokens": len(prep.request.prompt_token_ids), "output_tokens": 0,
                   "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    yield sse_event("message_start", {"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "content": [], "model": body.model,
        "stop_reason": None, "stop_sequence": None, "usage": start_usage}})
    yield sse_event("ping", {"type": "ping"})
    w = BlockWriter()
    async with ticket:
        async for ev in run_events(ctx.engine, prep):
            if isinstance(ev, ProgressEvent):
                yield sse_comment("progress", progress_json(ev.progress))
            elif isinstance(ev, Finished):
                if ctx.metrics:
                    ctx.metrics.observe_finish(ev.finish_reason, ev.usage)
                if ev.finish_reason == "error":
                    yield sse_error_data(finished_error(ev), Flavor.ANTHROPIC)
                    return
                for f in w.stop():
                    yield f
                reason, seq = stop_reason(ev, body)
                yield sse_event("message_delta", {"type": "message_delta",
                                                  "delta": {"stop_reason": reason, "stop_sequence": seq},
                                                  "usage": usage_json(ev.usage)})
                yield sse_event("message_stop", {"type": "message_stop"})
            else:
                for f in w.feed(ev):
                    yield f


@router.post("/v1/messages", tags=["anthropic"], responses=ANTHROPIC_STREAMING_RESPONSES)
async def create_message(body: MessagesRequest, request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    ctx.check_model(body.model)
    prep = messages_to_prepared(ctx, body)
    return await respond(ctx, request, prep, Flavor.ANTHROPIC, bool(body.stream),
                         lambda ticket: messages_stream(ctx, prep, body, ticket), internal_error_frame(Flavor.ANTHROPIC),
                         lambda res: message_body(prep, body, res))


def message_body(prep: Prepared, body: MessagesRequest, res: Collected) -> dict:
    content: list[dict] = []
    if res.reasoning:
        content.append({"type": "thinking", "thinking": res.reasoning, "signature": THINKING_SIGNATURE})
    if res.content:
        content.append({"type": "text", "text": res.content})
    content += [{"type": "tool_use", "id": _tool_id(c.id), "name": c.name, "input": tool_input(c.arguments)}
                for c in res.tool_calls]
    reason, seq = stop_reason(res.finished, body)
    return {"id": prep.request.request_id, "type": "message", "role": "assistant", "model": body.model,
            "content": content, "stop_reason": reason, "stop_sequence": seq,
            "usage": usage_json(res.finished.usage)}


@router.post("/v1/messages/count_tokens", tags=["anthropic"], responses=ANTHROPIC_ERROR_RESPONSES)
async def count_tokens(body: CountTokensRequest, request: Request) -> dict:
    ctx: ServerContext = request.app.state.ctx
    ctx.check_model(body.model)
    msgs, prefill = _messages(body)
    tools = _tools(body)
    choice = _choice(body, tools)
    offered = tools if choice.mode != "none" else None
    prompt = ctx.outputs.render(  # as the request would be encoded: earlier replies by their own ids
        ctx.tokenizer, msgs, lambda m: render_prompt(ctx.tokenizer, m, offered, _thinking(body)) + prefill)
    return {"input_tokens": len(prompt.token_ids)}
