"""The ASGI app (Starlette): OpenAI's /v1 routes over one Model, plus /health and /metrics.

Each generation request runs as two tasks: the work (wait for a place, generate, send) and a watcher
on the connection. Whichever ends first wins: a client that leaves cancels the work, which closes its
generator and so frees the sequence and its KV at once; admission is released in a ``finally``.
Stream responses send their headers with the first token, so a prompt refused by the engine or a read
that fails during the prefill is still an HTTP error status, not a broken stream.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..errors import ClutorError, ClutorIOError
from .admission import Admission, QueueFull
from .embeddings import embeddings_route
from .errors import APIError, bad_request, error_body
from .metrics import Metrics, watch_loop_lag
from ..formats import Delta, Message
from .requests import Defaults, GenRequest, check_model, parse_chat, parse_completion
from .messages_api import MessagesShaper, anthropic_error, parse_messages
from .responses import Shaper
from .responses_api import ResponsesShaper, parse_responses

__all__ = ["create_app", "ServerState"]

log = logging.getLogger("clutor.server")

STATIC = Path(__file__).parent / "static"  # the chat page: HTML, CSS and JS, served as they are


@dataclass
class ServerState:
    """What the routes share: the model (None while loading), limits, counters."""

    served_name: str | None
    api_key: str | None
    admission: Admission
    defaults: Defaults
    max_body: int
    model: object = None
    status: str = "loading"           # loading | ok | error | draining
    error: str | None = None
    batch_from_model: bool = False    # admit as many as the model's engine batches
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=lambda: int(time.time()))

    def set_model(self, model) -> None:
        self.model = model
        if self.batch_from_model:
            self.admission.max_live = model.options.max_sequences
        if self.status == "loading":
            self.status = "ok"

    @property
    def name(self) -> str:
        if self.served_name:
            return self.served_name
        path = getattr(self.model, "path", "model")
        stem = os.path.basename(path)
        return stem[:-5] if stem.endswith(".gguf") else stem

    def drain(self) -> None:
        """Stop taking work (health says so); requests in flight go on."""
        if self.status == "ok":
            self.status = "draining"


def create_app(model, *, served_model_name: str | None = None, api_key: str | None = None,
               max_sequences: int | None = None, max_queue: int = 64, max_body: int = 8 << 20,
               defaults: Defaults | None = None, cors_origins: tuple[str, ...] = (), pooling: str = "mean",
               web_ui: bool = True) -> Starlette:
    """An OpenAI-compatible ASGI app over ``model``.

    model: an open clutor Model (the caller keeps ownership), or an awaitable that opens one, e.g.
        ``clutor.Model.open(path)``: it is awaited in the background when the app's lifespan starts
        (/health answers 503 until it is ready) and closed when it ends. (Mounted inside another
        Starlette app, a sub-app gets no lifespan events: pass an open Model there.)
    max_sequences: generations running at once (default: the model's batch, Model.open(max_sequences=...));
        max_queue: requests waiting beyond those (then 429).
    max_body: largest request body in bytes (then 413).
    cors_origins: browser origins allowed to call the API ("*" = any); none by default.
    pooling: how /v1/embeddings pools a text's final hidden states ("mean" or "last").
    web_ui: serve the chat page at / (static files, no build step, nothing fetched from elsewhere).
    """
    state = ServerState(served_model_name, api_key, Admission(max_sequences or 1, max_queue),
                        defaults or Defaults(), max_body, batch_from_model=max_sequences is None)
    opened = hasattr(model, "generate")
    if opened:  # ready now: also when mounted in another app, whose lifespan never reaches this one
        state.set_model(model)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        lag = asyncio.ensure_future(watch_loop_lag(state.metrics))
        loader = None if opened else asyncio.ensure_future(_load(state, model))
        try:
            yield
        finally:
            lag.cancel()
            if loader is not None:
                loader.cancel()
                with contextlib.suppress(BaseException):
                    await loader
                if state.model is not None:
                    await state.model.aclose()

    routes = [
        Route("/v1/chat/completions", _gen_route(state, "chat"), methods=["POST"]),
        Route("/v1/completions", _gen_route(state, "completion"), methods=["POST"]),
        Route("/v1/responses", _gen_route(state, "responses"), methods=["POST"]),
        Route("/v1/messages", _gen_route(state, "messages"), methods=["POST"]),
        Route("/v1/models", _models(state), methods=["GET"]),
        Route("/v1/models/{name:path}", _models(state), methods=["GET"]),
        Route("/v1/embeddings", embeddings_route(state, pooling), methods=["POST"]),
        Route("/health", _health(state), methods=["GET"]),
        Route("/metrics", _metrics(state), methods=["GET"]),
    ]
    if web_ui:
        routes += [Route("/", _page, methods=["GET"]),
                   Mount("/static", StaticFiles(directory=str(STATIC)), name="static")]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error, APIError: _api_error})
    app.state.clutor = state
    outer = _Auth(app, state)
    if cors_origins:  # outermost, so a browser's preflight (no credentials) is answered before the key check
        from starlette.middleware.cors import CORSMiddleware

        cors = CORSMiddleware(outer, allow_origins=list(cors_origins), allow_methods=["GET", "POST", "OPTIONS"],
                              allow_headers=["*"])
        cors.state = app.state
        return cors
    return outer


async def _load(state: ServerState, opener: Awaitable) -> None:
    t0 = time.perf_counter()
    try:
        state.model = await opener
    except asyncio.CancelledError:
        raise
    except Exception as e:  # a bad file or budget: say so on /health and in the log, keep answering
        state.status, state.error = "error", str(e)
        log.error("loading the model failed: %s", e)
        return
    state.set_model(state.model)
    log.info("model %s ready in %.1f s (n_ctx %d)", state.name, time.perf_counter() - t0, state.model.n_ctx)


class _Auth:
    """With an API key, every /v1 route needs ``Authorization: Bearer KEY`` (or Anthropic's ``x-api-key: KEY``);
    /health and /metrics stay open."""

    def __init__(self, app: Starlette, state: ServerState):
        self.app = app
        self.state = app.state  # so callers can reach app.state.clutor on what create_app returned
        self._server = state

    async def __call__(self, scope, receive, send):
        key = self._server.api_key
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):  # mounted: Starlette keeps the mount prefix in path
            path = path[len(root):]
        if key and scope["type"] == "http" and path.startswith("/v1"):
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            # Anthropic's clients send the key as x-api-key
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get(b"x-api-key", b"").decode(
                "latin-1").strip()
            if not hmac.compare_digest(given.encode(), key.encode()):
                self._server.metrics.requests[(scope["path"], 401)] += 1
                log.info("- %s %s 401 (missing or wrong API key)", scope["method"], scope["path"])
                resp = JSONResponse(error_body(401, "Incorrect or missing API key: send 'Authorization: Bearer "
                                                    "<key>'", code="invalid_api_key"), status_code=401,
                                    headers={"www-authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


# -- small routes -----------------------------------------------------------------------------------
def _ready(state: ServerState) -> None:
    if state.status == "loading":
        raise APIError(503, "the model is still loading; retry shortly", code="model_loading",
                       headers={"retry-after": "2"})
    if state.status == "error":
        raise APIError(503, f"the model failed to load: {state.error}", code="model_load_failed")
    if state.status == "draining":
        raise APIError(503, "the server is shutting down", code="shutting_down")


def _models(state: ServerState):
    async def models(request: Request) -> Response:
        _ready(state)
        n_ctx = state.model.n_ctx
        # the context under the names clients read: vLLM's max_model_len, OpenRouter's context_length
        entry = {"id": state.name, "object": "model", "created": state.created, "owned_by": "clutor",
                 "max_model_len": n_ctx, "context_length": n_ctx,
                 "meta": {"n_ctx": n_ctx, "arch": state.model.config.arch}}
        name = request.path_params.get("name")
        if name is None:
            return JSONResponse({"object": "list", "data": [entry]})
        if name != state.name:
            raise APIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
        return JSONResponse(entry)

    return models


async def _page(request: Request) -> Response:
    from starlette.responses import FileResponse

    return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8")


def _health(state: ServerState):
    async def health(request: Request) -> Response:
        body = {"status": state.status}
        if state.error:
            body["error"] = state.error
        return JSONResponse(body, status_code=200 if state.status == "ok" else 503)

    return health


def _metrics(state: ServerState):
    async def metrics(request: Request) -> Response:
        text = state.metrics.render(model=state.model, admission=state.admission, state=state.status)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return metrics


async def _api_error(request: Request, e: APIError) -> Response:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _http_error(request: Request, e: HTTPException) -> Response:
    msg = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    return JSONResponse(error_body(e.status_code, msg.get(e.status_code, str(e.detail))), status_code=e.status_code,
                        headers=e.headers)


# -- generation -------------------------------------------------------------------------------------
def _gen_route(state: ServerState, kind: str):
    api = _API[kind]

    async def route(request: Request) -> Response:
        rid = api.prefix + uuid.uuid4().hex[:24]
        t0 = time.perf_counter()
        try:
            _ready(state)
            body = await _json_body(request, state.max_body)
            check_model(body, state.name)
            args = (body, state.model.tokenizer, state.model.n_ctx, state.defaults)
            if api.chat:  # a model with recurrent layers keeps its state where the next turn departs
                args += (state.model.config.recurrent_bytes > 0,)
            req = await asyncio.to_thread(api.parse, *args)
        except APIError as e:
            state.metrics.requests[(request.url.path, e.status)] += 1
            log.info("%s %s %d %s", rid, request.url.path, e.status, e.message)
            return JSONResponse(api.error(e), status_code=e.status, headers=e.headers)
        return _Generation(state, req, rid, request.url.path, t0, api)

    return route


@dataclass(frozen=True)
class _Api:
    """One API the generation routes speak: how its requests are read, its replies and errors shaped."""

    prefix: str                 # of its ids
    parse: object               # (body, tokenizer, n_ctx, defaults[, recurrent]) -> GenRequest
    shaper: object              # (req, rid, created, model name, tokenizer) -> a shaper (responses.py)
    error: object               # APIError -> body
    chat: bool = True           # a conversation (its parse takes the model's recurrent flag)


def _openai_shaper(req, rid, created, name, tok):
    return Shaper(req.kind, rid, created, name, tok, req.include_usage)


_API = {
    "chat": _Api("chatcmpl-", parse_chat, _openai_shaper, Shaper.error),
    "completion": _Api("cmpl-", parse_completion, _openai_shaper, Shaper.error, chat=False),
    "responses": _Api("resp_", parse_responses, ResponsesShaper, ResponsesShaper.error),
    "messages": _Api("msg_", parse_messages, MessagesShaper, anthropic_error),
}


async def _json_body(request: Request, limit: int) -> dict:
    cl = request.headers.get("content-length", "")
    if cl.isdigit() and int(cl) > limit:
        raise APIError(413, f"the request body is {int(cl)} bytes, over the server's limit of {limit}",
                       code="request_too_large")
    chunks, n = [], 0
    async for c in request.stream():
        n += len(c)
        if n > limit:
            raise APIError(413, f"the request body is over the server's limit of {limit} bytes",
                           code="request_too_large")
        chunks.append(c)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(None, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request(None, "the request body must be a JSON object")
    return body


class _Generation(Response):
    """Runs one admitted generation as the response itself (an ASGI callable), watching the connection."""

    def __init__(self, state: ServerState, req: GenRequest, rid: str, path: str, t0: float, api: _Api):
        self.s, self.req, self.rid, self.path, self.t0, self.api = state, req, rid, path, t0, api
        self.status = 0
        self.t_first: float | None = None
        self.stats = None
        self.note = ""
        self.background = None
        self.shaper = None
        self.matcher = None   # the grammar's, when the request constrains the reply

    async def __call__(self, scope, receive, send) -> None:
        work = asyncio.ensure_future(self._run(send))
        watch = asyncio.ensure_future(_disconnected(receive))
        shutdown = False
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server's drain ran out of time
            shutdown = True
        # Whoever is still running goes: on a disconnect that is the work (its generator closes and the
        # sequence is freed); on shutdown both.
        client_left = watch.done() and not watch.cancelled()
        for t in (work, watch):
            t.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
        if work.cancelled() and client_left:
            self.s.metrics.disconnects += 1
            self.note = "client disconnected"
        elif shutdown:
            # Answer rather than die mid-response: the client gets a clear error, not a torn connection.
            err = APIError(503, "the server shut down before this request finished; retry", code="shutting_down")
            with contextlib.suppress(Exception):
                if self.status == 0:
                    await self._error(send, err)
                else:
                    await self._stream_error(send, err)
            self.note = err.message
        self._log()

    async def _run(self, send) -> None:
        s, req = self.s, self.req
        try:
            await s.admission.acquire()
        except QueueFull as e:
            s.metrics.rejected_queue_full += 1
            await self._error(send, APIError(429, f"the server is at capacity ({s.admission.max_live} running, "
                                                  f"{s.admission.max_queue} queued); retry after {e.retry_after} s",
                                             code="rate_limit_exceeded",
                                             headers={"retry-after": str(e.retry_after)}))
            return
        t_admit = time.perf_counter()
        try:
            plan = req.plan
            self.matcher = plan.grammar.matcher() if plan is not None and plan.grammar is not None else None
            extra = {} if plan is None else dict(logits_processor=self.matcher, show_tokens=plan.show_tokens)
            agen = s.model.generate(req.ids, max_tokens=req.max_tokens, logprobs=req.logprobs, **req.options, **extra)
            try:
                if req.stream:
                    await self._stream(agen, send)
                else:
                    await self._whole(agen, send)
            finally:
                await agen.aclose()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the engine failed this request (a disk read, ...): 500, keep serving
            if isinstance(e, ClutorIOError):
                err = APIError(500, f"reading the model failed: {e}", code="io_error")
            elif isinstance(e, ClutorError):
                err = APIError(500, str(e), code="engine_error")
            else:
                log.exception("%s: unexpected error", self.rid)
                err = APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")
            if self.status == 0:
                await self._error(send, err)
            else:  # mid-stream: the status is sent already; end the stream with an error event
                self.note = err.message
                await self._stream_error(send, err)
        finally:
            s.admission.release(time.perf_counter() - t_admit)

    async def _start(self, send, content_type: bytes) -> None:
        self.status = 200
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", content_type), (b"cache-control", b"no-cache"),
                                (b"x-request-id", self.rid.encode())]})

    async def _error(self, send, e: APIError) -> None:
        self.status = e.status
        self.note = e.message
        resp = JSONResponse(self.api.error(e), status_code=e.status, headers={**e.headers, "x-request-id": self.rid})
        await resp({"type": "http"}, _never, send)

    async def _stream_error(self, send, e: APIError) -> None:
        shaper = self.shaper or self._shaper()
        name, body = shaper.stream_error(e)
        await _sse(send, body, more=False, event=name)

    def _shaper(self):
        shaper = self.api.shaper(self.req, self.rid, int(time.time()), self.s.name, self.s.model.tokenizer)
        shaper.grammar = self.matcher.stats if self.matcher is not None else None
        return shaper

    async def _whole(self, agen, send) -> None:
        parts, chunks = [], []
        async for c in agen:
            if self.t_first is None and c.token is not None:
                self.t_first = time.perf_counter()
            parts.append(c.text)
            if c.token is not None:
                chunks.append(c)
            if c.stats is not None:
                self.stats = c.stats
        self._count()
        text = "".join(parts)
        plan = self.req.plan
        # the whole reply parsed at once, off the event loop
        message = Message(content=text) if plan is None else await asyncio.to_thread(plan.parser().parse, text)
        body = self._shaper().whole(message, chunks, self.stats)
        await self._start(send, b"application/json")
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})

    async def _stream(self, agen, send) -> None:
        shaper = self.shaper = self._shaper()
        parser = self.req.plan.parser() if self.req.plan is not None else None
        async for c in agen:
            if self.status == 0:  # headers go with the first token: errors before it keep their status
                self.t_first = time.perf_counter()
                await self._start(send, b"text/event-stream")
                for ev in shaper.open():
                    await _sse(send, ev[1], event=ev[0])
            d = None
            if c.token is not None and (c.text or c.logprob is not None):
                d = parser.feed(c.text) if parser is not None else Delta(content=c.text)
                events = shaper.delta(d, [c])
            elif c.stats is not None:
                self.stats = c.stats
                d = Delta(content=c.text) if parser is None else parser.feed(c.text).extend(parser.finish())
                events = shaper.delta(d, [])
            else:
                events = []
            for ev in events:
                await _sse(send, ev[1], event=ev[0])
        self._count()
        shaper.grammar = self.matcher.stats if self.matcher is not None else None
        for ev in shaper.close(parser.message if parser is not None else None, self.stats):
            await _sse(send, ev[1], event=ev[0])
        await send({"type": "http.response.body", "body": shaper.done or b"", "more_body": False})

    def _count(self) -> None:
        m, st = self.s.metrics, self.stats
        m.prompt_tokens += st.prompt_tokens
        m.completion_tokens += st.generated_tokens
        m.cached_tokens += getattr(st, "cached_tokens", 0)
        if self.t_first is not None:
            m.ttft_sum += self.t_first - self.t0
            m.ttft_count += 1

    def _log(self) -> None:
        status = self.status or 499  # nginx's "client closed request"
        self.s.metrics.requests[(self.path, status)] += 1
        st = self.stats
        ttft = f"{self.t_first - self.t0:.3f}s" if self.t_first is not None else "-"
        if st is not None:
            tps = st.decode_tps
            log.info("%s %s %d prompt=%d cached=%d completion=%d ttft=%s %.2f tok/s stop=%s total=%.2fs",
                     self.rid, self.path, status, st.prompt_tokens, getattr(st, "cached_tokens", 0),
                     st.generated_tokens, ttft, tps, st.stop_reason, time.perf_counter() - self.t0)
        else:
            log.info("%s %s %d prompt=%d ttft=%s total=%.2fs %s", self.rid, self.path, status, len(self.req.ids),
                     ttft, time.perf_counter() - self.t0, self.note)


async def _sse(send, obj: dict, more: bool = True, event: str | None = None) -> None:
    head = b"event: " + event.encode() + b"\n" if event else b""
    await send({"type": "http.response.body", "body": head + b"data: " + json.dumps(obj).encode() + b"\n\n",
                "more_body": more})


async def _disconnected(receive) -> None:
    """Return when the client goes away (the body was read already, so the next message is the disconnect)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def _never():
    await asyncio.Future()
