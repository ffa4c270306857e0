"""The FastAPI app: routes of the three APIs, errors in each API's shape, and the guard.

    request -> CORS (only with config.cors) -> Guard (Host check on loopback,
    size limit, API key, per-endpoint metrics) -> route -> engine
"""

from __future__ import annotations

import gc
import hmac
import html
import logging
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvtier.config import ServerConfig
from kvtier.server import anthropic, openai, probes, responses
from kvtier.server.context import Admission, GrammarProvider, ServerContext
from kvtier.server.errors import (OPENAI_ERROR_RESPONSES, APIError, error_response, flavor_for_path,
                                  validation_message)
from kvtier.server.metrics import Metrics

log = logging.getLogger("kvtier.server")

LOOPBACK_BINDS = ("127.0.0.1", "localhost", "::1")
# Host names a browser can only reach on this machine (anything else on a loopback bind is DNS rebinding).
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
# Paths anyone who can reach the server may read: liveness, the API roots and the chat page itself.
PUBLIC_PATHS = ("/", "/health", "/openapi.json", "/docs", "/v1", "/v1/")
# The chat page's static files (kvtier/server/webui/): public like the page; its API calls carry the key.
WEBUI_PREFIX = "/webui/"
# The chat page may load and call only this server (model text can't pull in anything else).
WEBUI_CSP = ("default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
             "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
BODY_METHODS = (b"POST", b"PUT", b"PATCH")


def _host_name(host: str) -> str:
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class Guard:
    """Pure ASGI middleware (keeps `receive` intact, so disconnects still reach the routes)."""

    def __init__(self, app: ASGIApp, config: ServerConfig, metrics: Metrics):
        self.app = app
        self.config = config
        self.metrics = metrics
        self.check_host = config.host in LOOPBACK_BINDS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        err = self._refusal(path, headers, scope.get("method", "GET"))
        if err is None and scope.get("method", "").encode() in BODY_METHODS:
            receive, err = await self._buffer_body(receive, headers)
        status_seen: list[int] = []

        async def send_wrapper(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                status_seen.append(msg["status"])
            await send(msg)

        if err is not None:
            await error_response(err, flavor_for_path(path))(scope, receive, send_wrapper)
        else:
            await self.app(scope, receive, send_wrapper)
        if path.startswith("/v1/"):
            endpoint = path if not path.startswith("/v1/models/") else "/v1/models/{id}"
            self.metrics.requests.labels(endpoint, str(status_seen[0] if status_seen else 0)).inc()

    def _refusal(self, path: str, headers: dict[str, str], method: str) -> APIError | None:
        host = headers.get("host")
        if self.check_host and host is not None and _host_name(host).lower() not in LOOPBACK_HOSTS:
            return APIError(403, f"Host {host!r} is not a loopback name; this server listens on loopback only "
                                 "(DNS-rebinding guard)", err_type="permission_error")
        public = path in PUBLIC_PATHS or path.startswith(WEBUI_PREFIX)
        if self.config.api_key and not public and method != "OPTIONS":
            given = headers.get("x-api-key") or ""
            auth = headers.get("authorization", "")
            if auth.lower().startswith("bearer "):
                given = given or auth[7:].strip()
            if not hmac.compare_digest(given.encode(), self.config.api_key.encode()):
                return APIError(401, "Invalid or missing API key (send Authorization: Bearer KEY or x-api-key)",
                                code="invalid_api_key", err_type="authentication_error")
        return None

    async def _buffer_body(self, receive: Receive, headers: dict[str, str]) -> tuple[Receive, APIError | None]:
        limit = self.config.max_request_bytes
        too_big = APIError(413, f"request body exceeds the {limit:,}-byte limit", err_type="invalid_request_error")
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return receive, too_big
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return _replay([msg], receive), None
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > limit:
                return receive, too_big
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        return _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}], receive), None


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()
    return replay


def _install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc, flavor_for_path(request.url.path))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        errors = list(exc.errors())
        if any(e.get("type") == "json_invalid" for e in errors):
            err = APIError(400, "the request body is not valid JSON")
        else:
            msg, param = validation_message(errors)
            err = APIError(400, msg, param=param)
        return error_response(err, flavor_for_path(request.url.path))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(APIError(exc.status_code, str(exc.detail)), flavor_for_path(request.url.path))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, f"internal server error ({type(exc).__name__})"),
                              flavor_for_path(request.url.path))


def _served_names(engine, config: ServerConfig) -> tuple[str, ...]:
    names = [config.model_name, engine.model_name]
    return tuple(dict.fromkeys(n for n in names if n))


def create_app(engine, config: ServerConfig) -> FastAPI:
    """Build the app over an AsyncEngine (or anything with its interface)."""
    admission = Admission(config.max_concurrency, config.max_queue)
    metrics = Metrics(engine, admission)
    ctx = ServerContext(engine=engine, config=config, admission=admission,
                        grammars=GrammarProvider(engine.tokenizer, engine.vocab_size), metrics=metrics,
                        served=_served_names(engine, config))
    app = FastAPI(title="kvtier", version="0.1.0", docs_url="/docs", redoc_url=None,
                  description="OpenAI- and Anthropic-compatible LLM server")
    app.state.ctx = ctx
    _install_handlers(app)
    app.include_router(openai.router)
    app.include_router(responses.router)
    app.include_router(anthropic.router)
    app.include_router(probes.router)

    @app.get("/health", tags=["server"])
    async def health() -> dict:
        return {"status": "ok", "model": ctx.model_name, "max_model_len": ctx.max_model_len,
                "active": admission.active, "queued": admission.queued, "engine": _jsonable(engine.stats())}

    @app.get("/metrics", tags=["server"], response_class=Response, responses={
        200: {"description": "Prometheus text format", "content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}}})
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", include_in_schema=False)
    async def webui() -> HTMLResponse:
        page = resources.files("kvtier.server").joinpath("webui/index.html").read_text("utf-8")
        return HTMLResponse(page.replace("__MODEL__", html.escape(ctx.model_name)), headers={
            "content-security-policy": WEBUI_CSP, "cache-control": "no-cache", "referrer-policy": "no-referrer",
            "x-content-type-options": "nosniff"})

    app.mount(WEBUI_PREFIX.rstrip("/"), _WebUIFiles(packages=[("kvtier.server", "webui")]), name="webui")

    @app.get("/v1/kvtier/stats", tags=["server"], responses=OPENAI_ERROR_RESPONSES)
    async def kv_stats() -> dict:
        """The chat page's gauges: context window, KV pages per tier, requests in flight."""
        return webui_stats(engine.stats(), ctx, admission)

    app.add_middleware(probes.HeadAsGet)  # inside Guard: a HEAD is checked like its GET
    app.add_middleware(Guard, config=config, metrics=metrics)
    if config.cors:
        from fastapi.middleware.cors import CORSMiddleware
        origins = [config.cors] if isinstance(config.cors, str) else list(config.cors)
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["x-should-retry"])
    return app


class _WebUIFiles(StaticFiles):
    """The chat page's files, revalidated on every load (ETag), so an upgrade never mixes versions."""

    def file_response(self, *args, **kwargs) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers["cache-control"] = "no-cache"
        return response


KV_PAGE_STATES = ("total", "used", "cached", "free")


def webui_stats(stats: dict, ctx: ServerContext, admission: Admission) -> dict:
    """GET /v1/kvtier/stats from engine.stats() (kv/stats.py cache_stats keys; zeros where absent)."""
    cache = stats.get("cache") or {}

    def tier(name: str) -> dict[str, int]:
        return {f"pages_{s}": int(cache.get(f"{name}_pages_{s}", 0)) for s in KV_PAGE_STATES}
    return {"model": ctx.model_name, "max_model_len": ctx.max_model_len, "kv_format": stats.get("kv_format"),
            "device": stats.get("device", "cpu"),  # where the first tier lives: labels its gauge
            "running": stats.get("running", 0), "waiting": stats.get("waiting", 0),
            "active": admission.active, "queued": admission.queued, "gpu": tier("gpu"), "host": tier("host"),
            "prompt_tokens": int(cache.get("prompt_tokens", 0)),
            "cached_tokens_gpu": int(cache.get("cached_tokens_gpu", 0)),
            "cached_tokens_host": int(cache.get("cached_tokens_host", 0))}


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def serve(engine, config: ServerConfig) -> None:
    """Run the app under uvicorn until interrupted."""
    import uvicorn
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(engine, config)
    # The model, tokenizer, engine and imports (~370K objects: a full collection took 160 ms on a
    # 2-core CPU) go to the permanent generation, so no collection walks them between two tokens
    # of a stream; what requests allocate is collected as before.
    gc.collect()
    gc.freeze()
    uvicorn.run(app, host=config.host, port=config.port, log_level="info", timeout_graceful_shutdown=5)
