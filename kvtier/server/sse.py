"""Server-sent events with disconnect-driven cancellation.

Starlette's StreamingResponse (ASGI >= 2.4) only notices a departed client
when a write fails, which during a long prefill may be minutes away. Here a
watcher task waits for `http.disconnect` the whole time and cancels the
producer at once, so the engine request is aborted within one step.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger("kvtier.server")


def sse_data(obj: object) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_event(event: str, obj: object) -> str:
    return f"event: {event}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_comment(name: str, obj: object) -> str:
    """A comment line (`: name {json}`): SSE clients ignore it, humans and proxies see it."""
    return f": {name} {json.dumps(obj, separators=(',', ':'))}\n\n"


class SSEResponse(Response):
    """Stream `body` as text/event-stream; on disconnect cancel it and call `on_close`.

    on_error turns an unexpected exception from `body` into one last frame in the
    API's own error shape (the status line has already gone out as 200).
    """

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None] | None = None,
                 on_error: Callable[[Exception], str] | None = None, headers: dict | None = None):
        self.body_iterator = body
        self.on_close = on_close
        self.on_error = on_error
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})})

    async def _pump(self, send: Send) -> None:
        try:
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk.encode("utf-8"), "more_body": True})
        except (asyncio.CancelledError, OSError):
            raise
        except Exception as e:  # a bug must not leave the client hanging without an error frame
            log.exception("stream failed")
            if self.on_error is not None:
                await send({"type": "http.response.body", "body": self.on_error(e).encode("utf-8"),
                            "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = watch = None
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            pump = asyncio.ensure_future(self._pump(send))
            watch = asyncio.ensure_future(_wait_disconnect(receive))
            done, _ = await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
            if pump in done and not pump.cancelled() and pump.exception() is not None:
                if not isinstance(pump.exception(), OSError):
                    log.error("stream ended with %r", pump.exception())
        except OSError:  # the client went away while we wrote
            pass
        finally:
            for t in (pump, watch):
                if t is not None and not t.done():
                    t.cancel()
            await asyncio.gather(*(t for t in (pump, watch) if t is not None), return_exceptions=True)
            try:
                await self.body_iterator.aclose()
            except Exception:  # already closed or failed: nothing more to release
                pass
            if self.on_close is not None:
                self.on_close()


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        msg = await receive()
        if msg.get("type") == "http.disconnect":
            return
