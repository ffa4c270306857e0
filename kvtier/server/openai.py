"""OpenAI API: /v1/chat/completions, /v1/completions, /v1/models.

Chat stream (what openai-python's accumulator relies on):
    data: {delta: {role: "assistant", content: ""}}          first chunk only
    data: {delta: {content | reasoning_content | tool_calls}} ...
    data: {delta: {}, finish_reason}                          exactly one
    data: {choices: [], usage}                                with include_usage
    data: [DONE]
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvtier.server.context import ServerContext, Ticket
from kvtier.server.convert import (OutputFormat, ToolChoice, new_id, prepare, prepare_raw, stop_list,
                                   text_of, thinking_kwargs, tool_def)
from kvtier.server.errors import (OPENAI_ERROR_RESPONSES, OPENAI_STREAMING_RESPONSES, APIError, Flavor, bad_request,
                                  internal_error_frame, overflow_error_from, sse_error_data)
from kvtier.server.generation import (Collected, Finished, Prepared, ProgressEvent, ReasoningDelta, TextDelta,
                                      ToolCallArgsDelta, ToolCallStart, collect, run_events,
                                      until_disconnect)
from kvtier.server.protocol import ChatCompletionRequest, CompletionRequest
from kvtier.server.sse import SSEResponse, sse_comment, sse_data

router = APIRouter()
# Client closed the connection before the answer was ready (nginx's convention).
STATUS_CLIENT_CLOSED = 499
# Chat finish reasons that OpenAI clients accept; engine "abort" maps to "stop".
FINISH_MAP = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "abort": "stop"}


def usage_json(u) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def finished_error(fin: Finished) -> APIError:
    """An engine-side failure of a finished generation as an API error."""
    if fin.overflow is not None:
        return overflow_error_from(fin.overflow)
    return APIError(500, fin.error or "generation failed", err_type="server_error")


def progress_json(p) -> dict:
    return {"processed": p.processed, "total": p.total, "cached": p.cached}


# ---- request -> engine ---------------------------------------------------------

def _chat_messages(body: ChatCompletionRequest) -> list[dict]:
    out = []
    for i, m in enumerate(body.messages):
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
        msg: dict = {"role": role, "content": text_of(m.content, f"messages[{i}].content")}
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id or new_id("call_"), "type": "function", "function": {
                "name": c.function.name,
                "arguments": c.function.arguments if isinstance(c.function.arguments, str)
                else json.dumps(c.function.arguments, ensure_ascii=False)}} for c in m.tool_calls]
        if role == "tool":
            msg["tool_call_id"] = m.tool_call_id or ""
            if m.name:
                msg["name"] = m.name
        reasoning = m.reasoning_content or m.reasoning
        if role == "assistant" and reasoning:
            msg["reasoning_content"] = reasoning
        out.append(msg)
    return out


def _chat_choice(body: ChatCompletionRequest) -> ToolChoice:
    tc, parallel = body.tool_choice, body.parallel_tool_calls is not False
    if tc is None:
        return ToolChoice("auto" if body.tools else "none", parallel=parallel)
    if isinstance(tc, str):
        return ToolChoice(tc, parallel=parallel)
    return ToolChoice("named", tc.function.name, parallel=parallel)


def _chat_format(body: ChatCompletionRequest) -> OutputFormat:
    rf = body.response_format
    if rf is None or rf.type == "text":
        return OutputFormat()
    if rf.type == "json_object":
        return OutputFormat("json_object")
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise bad_request("response_format json_schema needs json_schema.schema", param="response_format")
    return OutputFormat("json_schema", rf.json_schema.schema_)


def chat_to_prepared(ctx: ServerContext, body: ChatCompletionRequest) -> Prepared:
    """The one function from a chat-completions request to an engine request."""
    tools = [tool_def(t.function.name, t.function.description, t.function.parameters)
             for t in body.tools or []]
    effort = body.reasoning_effort
    kwargs = thinking_kwargs(None if effort is None else effort != "none", body.chat_template_kwargs)
    return prepare(ctx, new_id("chatcmpl-"), _chat_messages(body), tools or None, _chat_choice(body),
                   _chat_format(body), body, body.max_completion_tokens or body.max_tokens,
                   stop_list(body.stop), kwargs)


def completion_to_prepared(ctx: ServerContext, body: CompletionRequest) -> Prepared:
    """The one function from a legacy completions request to an engine request."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
        if len(prompt) != 1:
            raise bad_request("only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = list(ctx.tokenizer.encode(prompt, add_special_tokens=True))
    else:
        vocab = ctx.grammars.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="prompt")
        ids = list(prompt)
    return prepare_raw(ctx, new_id("cmpl-"), ids, body, body.max_tokens, stop_list(body.stop))


async def _ticketed(ticket: Ticket, work):
    async with ticket:
        return await work


# ---- chat ----------------------------------------------------------------------

def _chunk(base: dict, delta: dict, finish: str | None = None, usage: bool = False) -> str:
    out = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
    if usage:
        out["usage"] = None
    return sse_data(out)


async def chat_stream(ctx: ServerContext, prep: Prepared, body: ChatCompletionRequest,
                      ticket: Ticket) -> AsyncIterator[str]:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    base = {"id": prep.request.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": body.model, "system_fingerprint": None}
    yield _chunk(base, {"role": "assistant", "content": ""}, usage=include_usage)
    async with ticket:
        async for ev in run_events(ctx.engine, prep):
            if isinstance(ev, TextDelta):
                yield _chunk(base, {"content": ev.text}, usage=include_usage)
            elif isinstance(ev, ReasoningDelta):
                yield _chunk(base, {"reasoning_content": ev.text}, usage=include_usage)
            elif isinstance(ev, ToolCallStart):
                call = {"index": ev.index, "id": ev.id, "type": "function",
                        "function": {"name": ev.name, "arguments": ""}}
                yield _chunk(base, {"tool_calls": [call]}, usage=include_usage)
            elif isinstance(ev, ToolCallArgsDelta):
                call = {"index": ev.index, "function": {"arguments": ev.text}}
                yield _chunk(base, {"tool_calls": [call]}, usage=include_usage)
            elif isinstance(ev, ProgressEvent):
                yield sse_comment("progress", progress_json(ev.progress))
                if body.return_progress:
                    yield sse_data({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": None,
                                                         "logprobs": None}],
                                    "prompt_progress": progress_json(ev.progress)})
            elif isinstance(ev, Finished):
                if ctx.metrics:
                    ctx.metrics.observe_finish(ev.finish_reason, ev.usage)
                if ev.finish_reason == "error":
                    yield sse_error_data(finished_error(ev), Flavor.OPENAI)
                    yield "data: [DONE]\n\n"
                    return
                yield _chunk(base, {}, FINISH_MAP.get(ev.finish_reason, "stop"), usage=include_usage)
                if include_usage:
                    yield sse_data({**base, "choices": [], "usage": usage_json(ev.usage)})
    yield "data: [DONE]\n\n"


def chat_body(prep: Prepared, body: ChatCompletionRequest, res) -> dict:
    fin = res.finished
    msg: dict = {"role": "assistant", "content": res.content if (res.content or not res.tool_calls) else None}
    if res.reasoning:
        msg["reasoning_content"] = res.reasoning
    if res.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}} for c in res.tool_calls]
    return {"id": prep.request.request_id, "object": "chat.completion", "created": int(time.time()),
            "model": body.model, "system_fingerprint": None,
            "choices": [{"index": 0, "message": msg, "logprobs": None,
                         "finish_reason": FINISH_MAP.get(fin.finish_reason, "stop")}],
            "usage": usage_json(fin.usage)}


async def run_collected(ctx: ServerContext, prep: Prepared, ticket: Ticket, request: Request):
    """Non-streamed generation under a ticket; None if the client left; raises on engine errors."""
    try:
        res = await until_disconnect(_ticketed(ticket, collect(ctx.engine, prep)), request)
    finally:
        ticket.release()
    if res is None:
        return None
    if ctx.metrics:
        ctx.metrics.observe_finish(res.finished.finish_reason, res.finished.usage)
    if res.finished.finish_reason == "error":
        raise finished_error(res.finished)
    return res


async def respond(ctx: ServerContext, request: Request, prep: Prepared, flavor: Flavor, stream: bool,
                  make_stream: Callable[[Ticket], AsyncIterator[str]], on_error: Callable[[Exception], str],
                  make_body: Callable[[Collected], dict]) -> Response:
    """Every generating endpoint: take an admission ticket, then stream SSE frames or run to the
    end and return one JSON body (499 if the client left first)."""
    ticket = ctx.admission.admit(flavor)
    if stream:
        return SSEResponse(make_stream(ticket), on_close=ticket.release, on_error=on_error)
    res = await run_collected(ctx, prep, ticket, request)
    if res is None:
        return Response(status_code=STATUS_CLIENT_CLOSED)
    return JSONResponse(make_body(res))


@router.post("/v1/chat/completions", tags=["openai"], responses=OPENAI_STREAMING_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    ctx.check_model(body.model)
    prep = chat_to_prepared(ctx, body)
    return await respond(ctx, request, prep, Flavor.OPENAI, bool(body.stream),
                         lambda ticket: chat_stream(ctx, prep, body, ticket), internal_error_frame(Flavor.OPENAI),
                         lambda res: chat_body(prep, body, res))


# ---- completions ---------------------------------------------------------------

async def completion_stream(ctx: ServerContext, prep: Prepared, body: CompletionRequest,
                            ticket: Ticket) -> AsyncIterator[str]:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    base = {"id": prep.request.request_id, "object": "text_completion", "created": int(time.time()),
            "model": body.model}

    def chunk(text: str, finish: str | None = None) -> str:
        out = {**base, "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
        if include_usage:
            out["usage"] = None
        return sse_data(out)

    if body.echo:
        yield chunk(ctx.tokenizer.decode(prep.request.prompt_token_ids))
    async with ticket:
        async for ev in run_events(ctx.engine, prep):
            if isinstance(ev, TextDelta):
                yield chunk(ev.text)
            elif isinstance(ev, ProgressEvent):
                yield sse_comment("progress", progress_json(ev.progress))
            elif isinstance(ev, Finished):
                if ctx.metrics:
                    ctx.metrics.observe_finish(ev.finish_reason, ev.usage)
                if ev.finish_reason == "error":
                    yield sse_error_data(finished_error(ev), Flavor.OPENAI)
                    break
                yield chunk("", FINISH_MAP.get(ev.finish_reason, "stop"))
                if include_usage:
                    yield sse_data({**base, "choices": [], "usage": usage_json(ev.usage)})
    yield "data: [DONE]\n\n"


@router.post("/v1/completions", tags=["openai"], responses=OPENAI_STREAMING_RESPONSES)
async def completions(body: CompletionRequest, request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    ctx.check_model(body.model)
    prep = completion_to_prepared(ctx, body)
    return await respond(ctx, request, prep, Flavor.OPENAI, bool(body.stream),
                         lambda ticket: completion_stream(ctx, prep, body, ticket), internal_error_frame(Flavor.OPENAI),
                         lambda res: completion_body(ctx, prep, body, res))


def completion_body(ctx: ServerContext, prep: Prepared, body: CompletionRequest, res: Collected) -> dict:
    text = (ctx.tokenizer.decode(prep.request.prompt_token_ids) if body.echo else "") + res.content
    return {
        "id": prep.request.request_id, "object": "text_completion", "created": int(time.time()),
        "model": body.model, "system_fingerprint": None,
        "choices": [{"index": 0, "text": text, "logprobs": None,
                     "finish_reason": FINISH_MAP.get(res.finished.finish_reason, "stop")}],
        "usage": usage_json(res.finished.usage)}


# ---- models --------------------------------------------------------------------

def _model_card(ctx: ServerContext, name: str) -> dict:
    return {"id": name, "object": "model", "created": ctx.created, "owned_by": "kvtier",
            "max_model_len": ctx.max_model_len}


@router.get("/v1/models", tags=["openai"], responses=OPENAI_ERROR_RESPONSES)
async def list_models(request: Request) -> dict:
    ctx: ServerContext = request.app.state.ctx
    return {"object": "list", "data": [_model_card(ctx, n) for n in ctx.served]}


@router.get("/v1/models/{model_id:path}", tags=["openai"], responses=OPENAI_ERROR_RESPONSES)
async def get_model(model_id: str, request: Request) -> dict:
    ctx: ServerContext = request.app.state.ctx
    ctx.check_model(model_id)
    return _model_card(ctx, model_id)
