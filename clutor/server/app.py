"""The ASGI app (Starlette): OpenAI's /v1 routes (and Anthropic's /v1/messages) over one Model, plus
/health, /metrics and the chat page.

Layers, outermost first: FrontDoor (smuggling, Host, Origin; every response counted; clutor.server.guard),
CORS when origins are allowed, KeyCheck when there is an API key, then the routes. Bounds on what a
client may send or hold come from one Limits (clutor.server.limits); what a client's text may become
in a label, a log line or a message, from clutor.server.labels.

A generation request's body is read with its size bounded, then decoded, checked and tokenised in a
worker thread (never on the event loop; a prompt that cannot fit the context is refused before it is
tokenised). It then runs as three tasks: the engine's output pumped into a queue (the batch place is
given back the moment the sequence ends, however slowly the client reads), the response written
from that queue, and a watcher on the connection. A client that leaves, or stops reading for the
write timeout, cancels the rest, which closes the generator and frees the sequence and its KV.
Stream responses send their headers with the first token, so a prompt refused by the engine or a
read that fails during the prefill is still an HTTP error status, not a broken stream.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Awaitable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..errors import ClutorError, ClutorIOError
from ..formats import Delta, Message
from .admission import Admission, QueueFull
from .embeddings import embeddings_route
from .errors import APIError, error_body
from .guard import FrontDoor, KeyCheck
from .labels import for_log, public, shown
from .limits import Limits
from .llama_completion import LlamaShaper, parse_llama_completion
from .llama_routes import llama_routes
from .ollama_api import OllamaShaper, ollama_routes, parse_ollama_chat, parse_ollama_generate
from .metrics import Metrics, watch_loop_lag
from .messages_api import MessagesShaper, anthropic_error, parse_messages
from .plumbing import ClientLeft, Nothing, read_json, ready
from .requests import Defaults, GenRequest, check_model, parse_chat, parse_completion
from .responses import JSON, Shaper, json_bytes
from .slots import SlotBook, slots_route
from .responses_api import ResponsesShaper, parse_responses

__all__ = ["create_app", "ServerState"]

log = logging.getLogger("clutor.server")

STATIC = Path(__file__).parent / "static"  # the chat page: HTML, CSS and JS, served as they are


@dataclass
class ServerState:
    """What the routes share: the model (None while loading), limits, counters."""

    served_name: str | None
    admission: Admission
    defaults: Defaults
    limits: Limits
    model: object = None
    status: str = "loading"           # loading | ok | error | draining
    error: str | None = None
    batch_from_model: bool = False    # admit as many as the model's engine batches
    freeze_heap: bool = False         # gc.freeze once the model is set (create_app's freeze_heap)
    metrics: Metrics = field(default_factory=Metrics)
    slots: SlotBook = field(default_factory=lambda: SlotBook(None))  # /slots (clutor.server.slots)
    created: int = field(default_factory=lambda: int(time.time()))
    page: bool = False                # the chat page is served at /
    pooling: str = "mean"             # how embeddings pool a text's final hidden states (--pooling)
    parsing: asyncio.Semaphore = field(init=False)  # bodies decoded and tokenised at once

    def __post_init__(self) -> None:
        self.parsing = asyncio.Semaphore(self.limits.tokenize_concurrency)

    def set_model(self, model) -> None:
        self.model = model
        if self.batch_from_model:
            self.admission.max_live = model.options.max_sequences
        if self.status == "loading":
            self.status = "ok"
        if self.freeze_heap:
            gc.collect()
            gc.freeze()

    @property
    def name(self) -> str:
        if self.served_name:
            return self.served_name
        path = getattr(self.model, "path", "model")
        stem = os.path.basename(path)
        return stem[:-5] if stem.endswith(".gguf") else stem

    def public(self, message: str, *paths) -> str:
        """A message for a client, without the model's path on this machine."""
        return public(message, [p for p in (getattr(self.model, "path", None), *paths) if p])

    def drain(self) -> None:
        """Stop taking work (health says so); requests in flight go on."""
        if self.status == "ok":
            self.status = "draining"


def create_app(model, *, served_model_name: str | None = None, api_key: str | None = None,
               max_sequences: int | None = None, max_queue: int = 64, max_body: int | None = None,
               defaults: Defaults | None = None, cors_origins: tuple[str, ...] = (),
               allowed_hosts: tuple[str, ...] = (), limits: Limits | None = None, pooling: str = "mean",
               web_ui: bool = True, freeze_heap: bool = False, slot_save_path: str | None = None) -> FrontDoor:
    """An OpenAI-compatible ASGI app over ``model``.

    model: an open clutor Model (the caller keeps ownership), or an awaitable that opens one, e.g.
        ``clutor.Model.open(path)``: it is awaited in the background when the app's lifespan starts
        (/health answers 503 until it is ready) and closed when it ends. (Mounted inside another
        Starlette app, a sub-app gets no lifespan events: pass an open Model there.)
    max_sequences: generations running at once (default: the model's batch, Model.open(max_sequences=...));
        max_queue: requests waiting beyond those (then 429).
    limits: body size, timeouts, connections (clutor.server.Limits); max_body overrides its max_body.
        The timeouts and the connection cap are enforced by clutor.server.run.Server's connections.
    cors_origins: browser origins allowed to call the API ("*" = any); none by default, and a page
        from any other origin is refused (403).
    allowed_hosts: Host names accepted on a loopback address besides the local ones ("*" = any).
    pooling: how /v1/embeddings pools a text's final hidden states ("mean" or "last").
    web_ui: serve the chat page at / (static files, no build step, nothing fetched from elsewhere).
    freeze_heap: once the model is open, collect and freeze the process's heap (gc.freeze), so the
        collector never walks what the process holds then again: the model's tables, the tokenizer, the
        compiled kernels (wide.gguf: 119k objects, a full collection of 50-55 ms, on whichever thread
        allocates, often the event loop, in the middle of streaming; after the freeze under 0.1 ms). For a
        process that serves this app alone (`clutor serve`); it changes the whole process's collector.
    slot_save_path: the directory of llama-server's POST /slots/{id}?action=save|restore files
        (clutor.server.slots); None: those answer 501.
    """
    limits = limits or Limits()
    if max_body is not None:
        limits = replace(limits, max_body=max_body)
    state = ServerState(served_model_name, Admission(max_sequences or 1, max_queue), defaults or Defaults(),
                        limits, batch_from_model=max_sequences is None, freeze_heap=freeze_heap)
    state.slots = SlotBook(os.fspath(slot_save_path) if slot_save_path is not None else None)
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
                    state.slots.close(state.model)
                    await state.model.aclose()

    routes = [
        Route("/v1/chat/completions", _gen_route(state, "chat"), methods=["POST"]),
        Route("/v1/completions", _gen_route(state, "completion"), methods=["POST"]),
        Route("/v1/responses", _gen_route(state, "responses"), methods=["POST"]),
        Route("/v1/messages", _gen_route(state, "messages"), methods=["POST"]),
        Route("/completion", _gen_route(state, "llama"), methods=["POST"]),
        Route("/completions", _gen_route(state, "llama"), methods=["POST"]),
        Route("/api/chat", _gen_route(state, "ollama_chat"), methods=["POST"]),
        Route("/api/generate", _gen_route(state, "ollama_generate"), methods=["POST"]),
        *ollama_routes(state),
        Route("/v1/models", _models(state), methods=["GET"]),
        Route("/v1/models/{name:path}", _models(state), methods=["GET"]),
        Route("/v1/embeddings", embeddings_route(state), methods=["POST"]),
        Route("/health", _health(state), methods=["GET"]),
        Route("/metrics", _metrics(state), methods=["GET"]),
        Route("/slots/{id_slot}", slots_route(state), methods=["POST"]),
        *llama_routes(state),
    ]
    state.page = bool(web_ui)
    state.pooling = pooling
    if web_ui:
        routes += [Route("/", _page, methods=["GET"]),
                   Mount("/static", StaticFiles(directory=str(STATIC)), name="static")]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error, APIError: _api_error, Exception: _internal})
    app.state.clutor = state
    inner = KeyCheck(app, api_key) if api_key else app
    if cors_origins:  # outside the key check, so a browser's preflight (no credentials) is answered
        from starlette.middleware.cors import CORSMiddleware

        inner = CORSMiddleware(inner, allow_origins=list(cors_origins), allow_methods=["GET", "POST", "OPTIONS"],
                               allow_headers=["*"])
    return FrontDoor(app, inner, state, allowed_hosts=allowed_hosts, allowed_origins=cors_origins)


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


# -- small routes -----------------------------------------------------------------------------------
def _models(state: ServerState):
    async def models(request: Request) -> Response:
        ready(state)
        n_ctx = state.model.n_ctx
        # the context under the names clients read: vLLM's max_model_len, OpenRouter's context_length
        entry = {"id": state.name, "object": "model", "created": state.created, "owned_by": "clutor",
                 "max_model_len": n_ctx, "context_length": n_ctx,
                 "meta": {"n_ctx": n_ctx, "arch": state.model.config.arch}}
        name = request.path_params.get("name")
        if name is None:
            return JSON({"object": "list", "data": [entry]})
        if name != state.name:
            raise APIError(404, f"The model {shown(name)} does not exist", param="model", code="model_not_found")
        return JSON(entry)

    return models


async def _page(request: Request) -> Response:
    from starlette.responses import FileResponse

    return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8")


def _health(state: ServerState):
    async def health(request: Request) -> Response:
        body = {"status": state.status}
        if state.error:
            body["error"] = state.error
        return JSON(body, 200 if state.status == "ok" else 503)

    return health


def _metrics(state: ServerState):
    async def metrics(request: Request) -> Response:
        text = state.metrics.render(model=state.model, admission=state.admission, state=state.status)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return metrics


# (each shaped by the API the path belongs to: errors.error_body)
async def _api_error(request: Request, e: APIError) -> Response:
    return JSON(e.body(request.url.path), e.status, e.headers)


async def _http_error(request: Request, e: HTTPException) -> Response:
    path = shown(request.url.path)
    msg = {404: f"no route {path}", 405: f"{request.method} is not allowed on {path}"}
    return JSON(error_body(e.status_code, msg.get(e.status_code, str(e.detail)), path=request.url.path),
                e.status_code, e.headers)


async def _internal(request: Request, e: Exception) -> Response:
    # The FrontDoor logs it (Starlette re-raises after this reply); the client gets JSON, not a text page.
    return JSON(error_body(500, f"internal error: {type(e).__name__}", code="internal_error", path=request.url.path),
                500)


# -- generation -------------------------------------------------------------------------------------
def _gen_route(state: ServerState, kind: str):
    api = _API[kind]
    path = api.path

    def parse(body: dict, tokenizer, n_ctx: int, recurrent: bool) -> GenRequest:  # in a worker thread
        check_model(body, state.name)
        args = (body, tokenizer, n_ctx, state.defaults)
        if api.chat:  # a model with recurrent layers keeps its state where the next turn departs
            args += (recurrent,)
        return api.parse(*args)

    async def route(request: Request) -> Response:
        rid = api.prefix + uuid.uuid4().hex[:24]
        t0 = time.perf_counter()
        try:
            ready(state)
            m = state.model
            req = await read_json(request, state, parse, m.tokenizer, m.n_ctx, m.config.recurrent_bytes > 0)
            if isinstance(req, dict):  # answered without generating (ollama's request that only loads the model)
                return JSON(req)
            if req.id_slot is not None and req.id_slot >= state.admission.max_live:
                raise APIError(400, f"'id_slot' must be in [0, {state.admission.max_live}) (the sequences served at "
                                    f"once), got {req.id_slot}", param="id_slot")
            spec = req.options.get("speculative")
            if isinstance(spec, dict) and spec.get("mode") == "draft" and getattr(m, "draft", None) is None:
                raise APIError(400, "'speculative.type' is 'draft' but this server has no draft model "
                                    "(clutor serve -md FILE)", param="speculative.type")
        except APIError as e:
            log.info("%s %s %d %s", rid, path, e.status, for_log(e.message))
            return JSON(api.error(e), e.status, e.headers)
        except ClientLeft:
            log.info("%s %s 499 the client left while sending its request", rid, path)
            return Nothing()
        return _Generation(state, req, rid, path, t0, api)

    return route


@dataclass(frozen=True)
class _Api:
    """One API the generation routes speak: how its requests are read, its replies and errors shaped."""

    prefix: str                 # of its ids
    path: str                   # its route
    parse: object               # (body, tokenizer, n_ctx, defaults[, recurrent]) -> GenRequest
    shaper: object              # (req, rid, created, model name, tokenizer) -> a shaper (responses.py)
    error: object               # APIError -> body
    chat: bool = True           # a conversation (its parse takes the model's recurrent flag)


def _openai_shaper(req, rid, created, name, tok):
    return Shaper(req.kind, rid, created, name, tok, req.include_usage)


_API = {
    "chat": _Api("chatcmpl-", "/v1/chat/completions", parse_chat, _openai_shaper, Shaper.error),
    "completion": _Api("cmpl-", "/v1/completions", parse_completion, _openai_shaper, Shaper.error, chat=False),
    "responses": _Api("resp_", "/v1/responses", parse_responses, ResponsesShaper, ResponsesShaper.error),
    "messages": _Api("msg_", "/v1/messages", parse_messages, MessagesShaper, anthropic_error),
    "llama": _Api("cmpl-", "/completion", parse_llama_completion, LlamaShaper, LlamaShaper.error, chat=False),
    "ollama_chat": _Api("chat-", "/api/chat", parse_ollama_chat, OllamaShaper, OllamaShaper.error),
    "ollama_generate": _Api("gen-", "/api/generate", parse_ollama_generate, OllamaShaper, OllamaShaper.error),
}


class _Failed:
    """The engine's error, carried through the chunk queue to the writer."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


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
        self.generated = 0    # tokens the engine gave this request
        self.sent = 0         # of those, tokens handed to the connection
        self.conn = None      # clutor.server.protocol.Connection, when served by clutor's Server

    async def __call__(self, scope, receive, send) -> None:
        ext = scope.get("extensions") or {}
        self.conn = ext.get("clutor.connection")
        delivery = ext.get("clutor.delivery")  # True once the response's last bytes left our buffer
        work = asyncio.ensure_future(self._run(send))
        watch = asyncio.ensure_future(self._watch(receive))
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
            self._undelivered()
        elif shutdown:
            # Answer rather than die mid-response: the client gets a clear error, not a torn connection.
            err = APIError(503, "the server shut down before this request finished; retry", code="shutting_down")
            with contextlib.suppress(Exception):
                if self.status == 0:
                    await self._error(send, err)
                else:
                    await self._stream_error(send, err)
            self.note = err.message
        if delivery is None or delivery.done() or self.status == 499:
            self._settled(delivery)
        else:  # written, not yet read: the client may still take it all, or be cut by the write timeout
            delivery.add_done_callback(self._settled)

    def _undelivered(self) -> None:
        """The client left, or was cut off, before its response's last bytes left our buffer."""
        self.s.metrics.disconnects += 1
        why = getattr(self.conn, "closed", None)
        self.note = (f"the client stopped reading for {self.s.limits.write_timeout:g} s: cut off"
                     if why == "write_timeout" else "the client left")
        self.status = 499  # the response (if started) is incomplete

    def _settled(self, delivery: asyncio.Future | None) -> None:
        """The request's log line, once its response is known delivered or not (always, when not served
        by clutor's Server: no future then, and uvicorn tells nothing after the last write)."""
        if delivery is not None and delivery.done() and not delivery.result() and self.status != 499:
            self._undelivered()
        self._log()

    async def _watch(self, receive) -> None:
        """Return when the client is gone (a half-closed client that still waits is not: the connection
        layer tells the two apart)."""
        await _disconnected(receive)

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
        chunks: asyncio.Queue = asyncio.Queue()
        pump = None
        try:
            plan = req.plan
            self.matcher = plan.grammar.matcher() if plan is not None and plan.grammar is not None else None
            pump = asyncio.ensure_future(self._pump(chunks))  # gives the place back when the sequence ends
            if req.stream:
                await self._stream(chunks, send)
            else:
                await self._whole(chunks, send)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the engine failed this request (a disk read, ...): 500, keep serving
            if isinstance(e, ClutorIOError):
                err = APIError(500, f"reading the model failed: {s.public(str(e), e.path)}", code="io_error")
            elif isinstance(e, ClutorError):
                err = APIError(500, s.public(str(e)), code="engine_error")
            else:
                log.error("%s: unexpected error: %s: %s", self.rid, type(e).__name__, for_log(str(e)), exc_info=e)
                err = APIError(500, f"internal error: {type(e).__name__}", code="internal_error")
            if self.status == 0:
                await self._error(send, err)
            else:  # mid-stream: the status is sent already; end the stream with an error event
                await self._stream_error(send, err)
            self.note = str(e) if isinstance(e, ClutorError) else err.message  # (the log keeps the paths)
        finally:
            if pump is None:
                s.admission.release()
            else:
                pump.cancel()
                await asyncio.gather(pump, return_exceptions=True)

    async def _pump(self, chunks: asyncio.Queue) -> None:
        """The engine's records into ``chunks`` as fast as they come, then the batch place back:
        admission counts sequences, not connections, so a reader that falls behind holds only its
        queued records (and its connection, until the write timeout), never a place in the batch."""
        s, req = self.s, self.req
        t_admit = time.perf_counter()
        try:
            plan = req.plan
            extra = {} if plan is None else dict(logits_processor=self.matcher, show_tokens=plan.show_tokens)
            agen = s.model.generate(req.ids, max_tokens=req.max_tokens, logprobs=req.logprobs, **req.options, **extra)
            made: list[int] = []
            try:
                async for c in agen:
                    if c.token is not None:
                        made.append(c.token)
                    chunks.put_nowait(c)
            finally:
                await agen.aclose()
            s.slots.ended(s.model, req.id_slot, req.ids + made[:-1])  # (the last token was never fed)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            chunks.put_nowait(_Failed(e))
        finally:
            s.admission.release(time.perf_counter() - t_admit)

    async def _records(self, chunks: asyncio.Queue):
        """The generation's records in order, up to the final one (with the stats); the engine's error raised."""
        while True:
            c = await chunks.get()
            if isinstance(c, _Failed):
                raise c.error
            if c.token is not None:
                self.generated += 1
            yield c
            if c.stats is not None:
                return

    def _handed(self) -> bool:
        """Whether what was just sent reached the connection (uvicorn drops writes to a lost one silently)."""
        return not getattr(self.conn, "lost", False)

    async def _start(self, send, content_type: bytes) -> None:
        self.status = 200
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", content_type), (b"cache-control", b"no-cache"),
                                (b"x-request-id", self.rid.encode())]})

    async def _error(self, send, e: APIError) -> None:
        self.status = e.status
        self.note = e.message
        resp = JSON(self.api.error(e), e.status, {**e.headers, "x-request-id": self.rid})
        await resp({"type": "http"}, _never, send)

    async def _stream_error(self, send, e: APIError) -> None:
        shaper = self.shaper or self._shaper()
        await _emit(send, shaper, shaper.stream_error(e), more=False)

    def _shaper(self):
        shaper = self.api.shaper(self.req, self.rid, int(time.time()), self.s.name, self.s.model.tokenizer)
        shaper.grammar = self.matcher.stats if self.matcher is not None else None
        return shaper

    async def _whole(self, chunks: asyncio.Queue, send) -> None:
        parts, records = [], []
        async for c in self._records(chunks):
            if self.t_first is None and c.token is not None:
                self.t_first = time.perf_counter()
            parts.append(c.text)
            if c.token is not None:
                records.append(c)
            if c.stats is not None:
                self.stats = c.stats
        self._count()
        text = "".join(parts)
        plan = self.req.plan
        # the whole reply parsed at once, off the event loop
        message = Message(content=text) if plan is None else await asyncio.to_thread(plan.parser().parse, text)
        body = self._shaper().whole(message, records, self.stats)
        await self._start(send, b"application/json")
        await send({"type": "http.response.body", "body": json_bytes(body)})
        if self._handed():
            self.sent = self.generated

    async def _stream(self, chunks: asyncio.Queue, send) -> None:
        shaper = self.shaper = self._shaper()
        parser = self.req.plan.parser() if self.req.plan is not None else None
        fast = getattr(shaper, "content_event", None)  # OpenAI's shaper; the other APIs' go through delta()
        seen = getattr(shaper, "seen", None)  # a shaper that keeps every token (ollama's context)
        async for c in self._records(chunks):
            if self.status == 0:  # headers go with the first token: errors before it keep their status
                self.t_first = time.perf_counter()
                await self._start(send, getattr(shaper, "media_type", b"text/event-stream"))
                for ev in shaper.open():
                    await _emit(send, shaper, ev)
            if seen is not None and c.token is not None:
                seen(c.token)
            d = None
            if c.token is not None and (c.text or c.logprob is not None):
                d = parser.feed(c.text) if parser is not None else Delta(content=c.text)
                if fast is not None and c.logprob is None and not d.reasoning and not d.calls:
                    # the common event, text and nothing else: its bytes without a chunk dict built
                    if d.content:
                        await send({"type": "http.response.body", "body": fast(d.content), "more_body": True})
                    if self._handed():
                        self.sent += 1
                    continue
                events = shaper.delta(d, [c])
            elif c.stats is not None:
                self.stats = c.stats
                d = Delta(content=c.text) if parser is None else parser.feed(c.text).extend(parser.finish())
                events = shaper.delta(d, [])
            else:
                events = []
            for ev in events:
                await _emit(send, shaper, ev)
            if c.token is not None and self._handed():
                self.sent += 1
        self._count()
        shaper.grammar = self.matcher.stats if self.matcher is not None else None
        for ev in shaper.close(parser.message if parser is not None else None, self.stats):
            await _emit(send, shaper, ev)
        await send({"type": "http.response.body", "body": shaper.done or b"", "more_body": False})

    def _count(self) -> None:
        m, st = self.s.metrics, self.stats
        m.prompt_tokens += st.prompt_tokens
        m.completion_tokens += st.generated_tokens
        m.cached_tokens += getattr(st, "cached_tokens", 0)
        m.disk_tokens += getattr(st, "disk_tokens", 0)
        m.prompt_windows += getattr(st, "prompt_windows", 0)
        if self.t_first is not None:
            m.ttft_sum += self.t_first - self.t0
            m.ttft_count += 1

    def _log(self) -> None:
        status = self.status or 499  # nginx's "client closed request"
        st = self.stats
        ttft = f"{self.t_first - self.t0:.3f}s" if self.t_first is not None else "-"
        total = time.perf_counter() - self.t0
        note = f" {for_log(self.note)}" if self.note else ""
        if st is not None:
            log.info("%s %s %d prompt=%d cached=%d completion=%d sent=%d ttft=%s %.2f tok/s stop=%s total=%.2fs%s",
                     self.rid, self.path, status, st.prompt_tokens, getattr(st, "cached_tokens", 0),
                     st.generated_tokens, self.sent, ttft, st.decode_tps, st.stop_reason, total, note)
        else:
            log.info("%s %s %d prompt=%d generated=%d sent=%d ttft=%s total=%.2fs%s", self.rid, self.path, status,
                     len(self.req.ids), self.generated, self.sent, ttft, total, note)


async def _emit(send, shaper, ev: tuple[str | None, dict], more: bool = True) -> None:
    """One stream event (name, body): the shaper's own framing (ollama's NDJSON lines), else server-sent events."""
    frame = getattr(shaper, "frame", None)
    if frame is not None:
        await send({"type": "http.response.body", "body": frame(ev[1]), "more_body": more})
    else:
        await _sse(send, ev[1], more, ev[0])


async def _sse(send, obj: dict, more: bool = True, event: str | None = None) -> None:
    head = b"event: " + event.encode() + b"\n" if event else b""
    await send({"type": "http.response.body", "body": head + b"data: " + json_bytes(obj) + b"\n\n",
                "more_body": more})


async def _disconnected(receive) -> None:
    """Return when the client goes away (the body was read already, so the next message is the disconnect)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def _never():
    await asyncio.Future()
