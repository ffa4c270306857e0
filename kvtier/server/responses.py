"""OpenAI Responses API: /v1/responses (what Codex-style agents speak).

Stream order (openai-python's ResponseStreamState and Codex both check it):
    response.created, response.in_progress
    per output item: output_item.added -> [content_part.added] -> *.delta ... -> *.done
                     -> [content_part.done] -> output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed
Every frame carries `event:` and an increasing `sequence_number`; no [DONE].
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvtier.server.context import ServerContext, Ticket
from kvtier.server.convert import OutputFormat, ToolChoice, new_id, prepare, text_of, thinking_kwargs, tool_def
from kvtier.server.errors import OPENAI_STREAMING_RESPONSES, APIError, Flavor, bad_request
from kvtier.server.generation import (Collected, Finished, Prepared, ProgressEvent, ReasoningDelta, TextDelta,
                                      ToolCallArgsDelta, ToolCallStart, run_events)
from kvtier.server.openai import finished_error, progress_json, respond
from kvtier.server.protocol import ResponsesRequest
from kvtier.server.sse import SSEResponse, sse_comment, sse_event

router = APIRouter()
log = logging.getLogger("kvtier.server")


# ---- request -> engine ---------------------------------------------------------

def _item_type(item: dict) -> str | None:
    return item.get("type") or ("message" if "role" in item else None)


def _reasoning_text(item: dict) -> str:
    parts = item.get("content") or item.get("summary") or []
    return "".join(p.get("text", "") for p in parts if isinstance(p, dict))


def _input_messages(body: ResponsesRequest) -> list[dict]:
    msgs: list[dict] = []
    if body.instructions:
        msgs.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return msgs + [{"role": "user", "content": body.input}]
    reasoning: str | None = None
    for i, item in enumerate(body.input):
        kind, where = _item_type(item), f"input[{i}]"
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("system", "user", "assistant"):
                raise bad_request(f"{where}.role must be user, assistant, system or developer", param=where)
            msg = {"role": role, "content": text_of(item.get("content"), f"{where}.content")}
            if role == "assistant" and reasoning:
                msg["reasoning_content"], reasoning = reasoning, None
            msgs.append(msg)
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments", "{}"), str):
                raise bad_request(f"{where}: a function_call needs a string name and arguments", param=where)
            call = {"id": item.get("call_id") or new_id("call_"), "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments", "{}")}}
            if not msgs or msgs[-1]["role"] != "assistant":
                msgs.append({"role": "assistant", "content": ""})
                if reasoning:
                    msgs[-1]["reasoning_content"], reasoning = reasoning, None
            msgs[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            out = item.get("output", "")
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id") or "",
                         "content": out if isinstance(out, str) else text_of(out, f"{where}.output")})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item)
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported", param=where)
    return msgs


def _tools(body: ResponsesRequest) -> list[dict] | None:
    tools = []
    for t in body.tools or []:
        if t.get("type") != "function":
            log.info("ignoring a %r tool: only function tools run on a local model", t.get("type"))
            continue
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad_request("every function tool needs a name", param="tools")
        params = t.get("parameters")
        tools.append(tool_def(t["name"], t.get("description"), params if isinstance(params, dict) else None))
    return tools or None


def _choice(body: ResponsesRequest, tools: list[dict] | None) -> ToolChoice:
    tc, parallel = body.tool_choice, body.parallel_tool_calls is not False
    if tc is None:
        return ToolChoice("auto" if tools else "none", parallel=parallel)
    if isinstance(tc, str):
        return ToolChoice(tc, parallel=parallel)
    if tc.get("type") == "function" and isinstance(tc.get("name"), str):
        return ToolChoice("named", tc["name"], parallel=parallel)
    return ToolChoice("auto" if tools else "none", parallel=parallel)


def _format(body: ResponsesRequest) -> OutputFormat:
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return OutputFormat()
    if fmt.type == "json_object":
        return OutputFormat("json_object")
    if fmt.schema_ is None:
        raise bad_request("text.format json_schema needs a schema", param="text.format")
    return OutputFormat("json_schema", fmt.schema_)


def responses_to_prepared(ctx: ServerContext, body: ResponsesRequest) -> Prepared:
    """The one function from a Responses request to an engine request."""
    if body.previous_response_id:
        raise bad_request("previous_response_id is not supported (this server stores no responses); "
                          "send the whole conversation as input", param="previous_response_id")
    tools = _tools(body)
    effort = body.reasoning.effort if body.reasoning else None
    kwargs = thinking_kwargs(None if effort is None else effort != "none")
    return prepare(ctx, new_id("resp_"), _input_messages(body), tools, _choice(body, tools), _format(body),
                   body, body.max_output_tokens, (), kwargs)


# ---- engine -> response ------------------------------------------------------------

def usage_json(u) -> dict:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def response_json(rid: str, body: ResponsesRequest, created: int, status: str, output: list,
                  usage: dict | None = None, error: dict | None = None) -> dict:
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format \
        else {"type": "text"}
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": body.model,
            "output": output, "usage": usage, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto", "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature, "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens, "previous_response_id": None,
            "text": {"format": fmt}, "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                                                    "summary": None},
            "metadata": body.metadata or {}, "store": False}


def _status(fin: Finished) -> str:
    return {"length": "incomplete", "error": "failed"}.get(fin.finish_reason, "completed")


def _error_json(fin: Finished) -> dict | None:
    if fin.finish_reason != "error":
        return None
    err = finished_error(fin)
    return {"code": err.code or "server_error", "message": err.message}


def message_item(mid: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(rid: str, text: str) -> dict:
    return {"type": "reasoning", "id": rid, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(fid: str, call_id: str, name: str, args: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": fid, "call_id": call_id, "name": name, "arguments": args,
            "status": status}


class EventWriter:
    """Turns parser events into Responses stream frames, one output item at a time."""

    def __init__(self, rid: str, body: ResponsesRequest, created: int):
        self.rid, self.body, self.created = rid, body, created
        self.seq = 0
        self.output: list[dict] = []  # finished items
        self.kind: str | None = None  # kind of the open item
        self.item: dict = {}
        self.text = ""

    def ev(self, etype: str, **data) -> str:
        frame = sse_event(etype, {"type": etype, "sequence_number": self.seq, **data})
        self.seq += 1
        return frame

    def response(self, status: str, **kw) -> dict:
        return response_json(self.rid, self.body, self.created, status, list(self.output), **kw)

    def _open(self, kind: str, item: dict) -> list[str]:
        frames = self.close()
        self.kind, self.item, self.text = kind, item, ""
        idx = len(self.output)
        frames.append(self.ev("response.output_item.added", output_index=idx, item=item))
        part = {"message": {"type": "output_text", "text": "", "annotations": []},
                "reasoning": {"type": "reasoning_text", "text": ""}}.get(kind)
        if part is not None:
            frames.append(self.ev("response.content_part.added", item_id=item["id"], output_index=idx,
                                  content_index=0, part=part))
        return frames

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        idx, iid, text = len(self.output), self.item["id"], self.text
        frames = []
        if self.kind == "message":
            done = message_item(iid, text)
            frames.append(self.ev("response.output_text.done", item_id=iid, output_index=idx, content_index=0,
                                  text=text, logprobs=[]))
            frames.append(self.ev("response.content_part.done", item_id=iid, output_index=idx,
                                  content_index=0, part=done["content"][0]))
        elif self.kind == "reasoning":
            done = reasoning_item(iid, text)
            frames.append(self.ev("response.reasoning_text.done", item_id=iid, output_index=idx,
                                  content_index=0, text=text))
            frames.append(self.ev("response.content_part.done", item_id=iid, output_index=idx,
                                  content_index=0, part=done["content"][0]))
        else:
            done = call_item(iid, self.item["call_id"], self.item["name"], text)
            frames.append(self.ev("response.function_call_arguments.done", item_id=iid, output_index=idx,
                                  name=self.item["name"], arguments=text))
        frames.append(self.ev("response.output_item.done", output_index=idx, item=done))
        self.output.append(done)
        self.kind = None
        return frames

    def feed(self, ev) -> list[str]:
        frames: list[str] = []
        idx = len(self.output)
        if isinstance(ev, TextDelta):
            if self.kind != "message":
                frames += self._open("message", message_item(new_id("msg_"), "", "in_progress") | {"content": []})
                idx = len(self.output)
            self.text += ev.text
            frames.append(self.ev("response.output_text.delta", item_id=self.item["id"], output_index=idx,
                                  content_index=0, delta=ev.text, logprobs=[]))
        elif isinstance(ev, ReasoningDelta):
            if self.kind != "reasoning":
                frames += self._open("reasoning", {"type": "reasoning", "id": new_id("rs_"), "summary": []})
                idx = len(self.output)
            self.text += ev.text
            frames.append(self.ev("response.reasoning_text.delta", item_id=self.item["id"], output_index=idx,
                                  content_index=0, delta=ev.text))
        elif isinstance(ev, ToolCallStart):
            frames += self._open("function_call", call_item(new_id("fc_"), ev.id, ev.name, "", "in_progress"))
        elif isinstance(ev, ToolCallArgsDelta) and self.kind == "function_call":
            self.text += ev.text
            frames.append(self.ev("response.function_call_arguments.delta", item_id=self.item["id"],
                                  output_index=idx, delta=ev.text))
        return frames

    def finish(self, fin: Finished) -> list[str]:
        frames = self.close()
        status = _status(fin)
        etype = {"completed": "response.completed", "incomplete": "response.incomplete",
                 "failed": "response.failed"}[status]
        frames.append(self.ev(etype, response=self.response(status, usage=usage_json(fin.usage),
                                                             error=_error_json(fin))))
        return frames


async def responses_stream(ctx: ServerContext, prep: Prepared | None, body: ResponsesRequest,
                           ticket: Ticket | None, rid: str, early: Finished | None = None) -> AsyncIterator[str]:
    w = EventWriter(rid, body, int(time.time()))
    yield w.ev("response.created", response=w.response("in_progress"))
    yield w.ev("response.in_progress", response=w.response("in_progress"))
    if early is not None or prep is None or ticket is None:
        for f in w.finish(early):
            yield f
        return
    async with ticket:
        async for ev in run_events(ctx.engine, prep):
            if isinstance(ev, ProgressEvent):
                yield sse_comment("progress", progress_json(ev.progress))
            elif isinstance(ev, Finished):
                if ctx.metrics:
                    ctx.metrics.observe_finish(ev.finish_reason, ev.usage)
                for f in w.finish(ev):
                    yield f
            else:
                for f in w.feed(ev):
                    yield f


def _error_frame(e: Exception) -> str:
    data = {"type": "error", "sequence_number": 0, "code": "server_error",
            "message": f"internal error: {type(e).__name__}", "param": None}
    return sse_event("error", data)


def _overflow_stream(ctx: ServerContext, body: ResponsesRequest, err: APIError) -> SSEResponse:
    """A streamed request past the context fails the Codex way: response.failed, context_length_exceeded."""
    from kvtier.engine.request import Usage
    fin = Finished("error", Usage(), error=err.message)
    fin.overflow = ValueError(err.message)
    return SSEResponse(responses_stream(ctx, None, body, None, new_id("resp_"), early=fin), on_error=_error_frame)


@router.post("/v1/responses", tags=["openai"], responses=OPENAI_STREAMING_RESPONSES)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    ctx.check_model(body.model)
    try:
        prep = responses_to_prepared(ctx, body)
    except APIError as e:
        if body.stream and e.code == "context_length_exceeded":
            return _overflow_stream(ctx, body, e)
        raise
    rid = prep.request.request_id
    return await respond(ctx, request, prep, Flavor.OPENAI, bool(body.stream),
                         lambda ticket: responses_stream(ctx, prep, body, ticket, rid), _error_frame,
                         lambda res: response_body(rid, body, res))


def response_body(rid: str, body: ResponsesRequest, res: Collected) -> dict:
    output = []
    if res.reasoning:
        output.append(reasoning_item(new_id("rs_"), res.reasoning))
    if res.content or not res.tool_calls:
        output.append(message_item(new_id("msg_"), res.content))
    output += [call_item(new_id("fc_"), c.id, c.name, c.arguments) for c in res.tool_calls]
    fin = res.finished
    return response_json(rid, body, int(time.time()), _status(fin), output, usage=usage_json(fin.usage))
