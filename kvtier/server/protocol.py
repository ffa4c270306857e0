"""Pydantic request schemas of the three APIs (what /openapi.json documents).

Unknown fields are accepted and ignored (clients send many vendor extras);
known fields are type-checked, so a wrong type is a 400, never a 500.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Seeds go to torch.Generator.manual_seed, which takes a 64-bit value.
MAX_SEED = 2**63 - 1
# No request may ask for more tokens than any context could hold.
MAX_TOKENS_LIMIT = 2**31 - 1


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class Sampling(_Lenient):
    """Sampling knobs shared by the OpenAI-style APIs (vendor extras included)."""

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOKENS_LIMIT)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    seed: int | None = Field(None, ge=-MAX_SEED, le=MAX_SEED)
    ignore_eos: bool = False
    return_progress: bool = Field(False, description="stream llama.cpp-style prompt_progress chunks")


class StreamOptions(_Lenient):
    include_usage: bool = False


# ---- /v1/chat/completions ----------------------------------------------------

class FunctionCallIn(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(_Lenient):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class JSONSchemaFormat(_Lenient):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class ChatCompletionRequest(Sampling):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    n: int = Field(1, ge=1, le=1, description="only n=1 is supported")
    logprobs: bool | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    user: str | None = None


# ---- /v1/completions ---------------------------------------------------------

class CompletionRequest(Sampling):
    model: str
    prompt: str | list[str] | list[int] = Field(description="text, one-item list of text, or token ids")
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS_LIMIT)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    n: int = Field(1, ge=1, le=1, description="only n=1 is supported")
    logprobs: int | None = None
    user: str | None = None


# ---- /v1/responses -----------------------------------------------------------

class ResponsesTextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponsesText(_Lenient):
    format: ResponsesTextFormat | None = None


class ResponsesReasoning(_Lenient):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(Sampling):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    stream: bool = False
    text: ResponsesText | None = None
    reasoning: ResponsesReasoning | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None


# ---- /v1/messages ------------------------------------------------------------

class AnthropicMessage(_Lenient):
    # "system" anywhere in messages: Claude Code's mid-conversation system beta
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class AnthropicTool(_Lenient):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class AnthropicToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AnthropicThinking(_Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class _AnthropicBase(_Lenient):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None


class MessagesRequest(_AnthropicBase):
    max_tokens: int = Field(ge=1, le=MAX_TOKENS_LIMIT)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=MAX_TOKENS_LIMIT)
    stream: bool = False
    metadata: dict[str, Any] | None = None


class CountTokensRequest(_AnthropicBase):
    pass
