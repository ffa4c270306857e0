"""What clients probe before they talk: `HEAD` on any GET route, and the API roots.

Claude Code sends `HEAD /` to check the server is up before its first request; SDK-based tools
`GET /v1`. HTTP says HEAD is GET without the body, so every GET route (the chat page at `/`,
`/health`, `/v1/models` …) answers it without declaring it.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

router = APIRouter()
# Where each API's requests go, for a person who opens the root in a browser.
API_ROUTES = {"openai": ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models"],
              "anthropic": ["/v1/messages", "/v1/messages/count_tokens"]}


class HeadAsGet:
    """ASGI middleware: a HEAD request runs the GET route and goes out with headers only."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(msg: Message) -> None:
            if msg["type"] == "http.response.body":
                if msg.get("more_body", False):
                    return
                msg = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(msg)

        await self.app({**scope, "method": "GET"}, receive, headers_only)


@router.get("/v1", include_in_schema=False)
@router.get("/v1/", include_in_schema=False)
async def api_root(request: Request) -> dict:
    ctx = request.app.state.ctx
    return {"object": "api_root", "model": ctx.model_name, "max_model_len": ctx.max_model_len,
            "routes": API_ROUTES}
