"""The HTTP server: OpenAI's /v1/completions and /v1/chat/completions (streamed with
server-sent events or not), /v1/models, /health and /metrics, over one Scheduler that a
worker thread runs.

Requests reach the scheduler from the event loop (``submit`` and ``cancel`` are thread-safe);
its events come back through ``loop.call_soon_threadsafe`` into one asyncio queue per
request. A client that goes away cancels its request, which frees its slot before the next
decode step. Errors have OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specdraft.errors import ContextOverflowError, SpecdraftError
from specdraft.scheduler import Overloaded, Request, RequestEvent, Scheduler
from specdraft.server.metrics import ServerMetrics
from specdraft.server.protocol import BadRequest, ChatRequest, CompletionRequest

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


@dataclass
class ServerState:
    scheduler: Scheduler
    model_id: str
    method: str
    metrics: ServerMetrics = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()))
    allow_reset: bool = False  # POST /reset_memory (benchmarks: each cell starts from the same state)
    stopping: threading.Event = field(default_factory=threading.Event)
    worker: threading.Thread | None = None

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.scheduler, self.method)

    def start(self) -> None:
        self.worker = threading.Thread(target=self._loop, name="specdraft-scheduler", daemon=True)
        self.worker.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.worker is not None:
            self.worker.join(timeout=30)

    def _loop(self) -> None:
        s = self.scheduler
        while not self.stopping.is_set():
            try:
                if not s.run_once():
                    s.wait_for_work(0.1)
            except Exception as e:  # a bug, not a user error: fail what is in flight, keep serving
                traceback.print_exc()
                s.fail_all(f"internal error: {type(e).__name__}: {e}")


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class _Job:
    """One request as the event loop sees it: the scheduler's events, queued."""

    def __init__(self, state: ServerState, endpoint: str) -> None:
        self.state = state
        self.endpoint = endpoint
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[RequestEvent] = asyncio.Queue()
        self.request: Request | None = None
        self.id = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex[:24]

    def on_event(self, event: RequestEvent) -> None:  # the scheduler's thread
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed (shutting down): nobody is listening
            pass

    def cancel(self) -> None:
        if self.request is not None:
            self.state.scheduler.cancel(self.request)

    def done(self, outcome: str) -> None:
        if self.request is not None:
            self.state.metrics.finished(self.endpoint, self.request, outcome)

    def usage(self) -> dict[str, object]:
        r = self.request
        assert r is not None
        stats = r.seq.stats
        return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                "total_tokens": r.prompt_tokens + r.completion_tokens,
                "completion_tokens_details": {"accepted_prediction_tokens": stats.accepted,
                                              "rejected_prediction_tokens": stats.proposed - stats.accepted}}


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start()
        yield
        state.stop()

    app = FastAPI(title="specdraft", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON")
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}"
        if first.get("type") == "extra_forbidden":
            message = f"unknown field {'.'.join(loc)!r}"
        return error_response(400, message, param=".".join(loc) or None)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": state.created,
                                            "owned_by": "specdraft"}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/reset_memory")
    async def reset_memory() -> Response:
        """Forget what the engine learned from earlier requests (``Scheduler.reset_memory``):
        for benchmarks, enabled with ``--allow-reset``; only while no request is in flight."""
        if not state.allow_reset:
            return error_response(404, "resetting is not enabled on this server (--allow-reset)", code="not_found")
        done = state.scheduler.reset_memory()
        if done is None:
            return error_response(409, "requests are in flight; reset only an idle server", kind="conflict")
        if not await asyncio.to_thread(done.wait, 30):
            return error_response(503, "the scheduler did not reset within 30 s", kind="server_error")
        return JSONResponse({"reset": True})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest) -> Response:
        return await _serve(state, "completions", body, http)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: HttpRequest) -> Response:
        return await _serve(state, "chat", body, http)

    return app


async def _serve(state: ServerState, endpoint: str, body: CompletionRequest | ChatRequest,
                 http: HttpRequest) -> Response:
    if body.model is not None and body.model != state.model_id:
        state.metrics.rejected(endpoint, "not_found")
        return error_response(404, f"the model {body.model!r} does not exist; this server serves {state.model_id!r}",
                              param="model", code="model_not_found")
    job = _Job(state, endpoint)
    try:
        body.check_unsupported()
        tokenizer = state.scheduler.engine.tokenizer
        prompt = body.prompt_ids(tokenizer)
        limits = body.limits(body.max_new(len(prompt), state.scheduler.row_capacity))
        job.request = state.scheduler.submit(prompt, limits, body.sampling(), job.on_event)
    except Overloaded as e:
        state.metrics.rejected(endpoint, "overloaded")
        return error_response(503, str(e), kind="server_overloaded", headers={"Retry-After": "1"})
    except ContextOverflowError as e:
        state.metrics.rejected(endpoint, "invalid")
        return error_response(400, str(e), param="max_tokens", code="context_length_exceeded")
    except BadRequest as e:
        state.metrics.rejected(endpoint, "invalid")
        return error_response(400, str(e), param=e.param)
    except SpecdraftError as e:
        state.metrics.rejected(endpoint, "invalid")
        return error_response(400, str(e))
    state.metrics.prompt_tokens.inc(len(prompt))
    if body.stream:
        return StreamingResponse(_stream(job, body), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await _whole(job, http)


async def _whole(job: _Job, http: HttpRequest) -> Response:
    """Wait for the whole text; a client that goes away cancels the request. Whether it is still
    there is asked every ``DISCONNECT_POLL_S``, also while text keeps arriving (a busy request
    never waits that long for its next event)."""
    parts: list[str] = []
    checked = time.monotonic()
    try:
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                event = None
            if event is None or time.monotonic() - checked >= DISCONNECT_POLL_S:
                checked = time.monotonic()
                if await http.is_disconnected():
                    job.cancel()
                    job.done("cancelled")
                    return Response(status_code=499)
            if event is None:
                continue
            parts.append(event.text)
            if event.finished:
                break
    except asyncio.CancelledError:
        job.cancel()
        job.done("cancelled")
        raise
    if event.error is not None:
        job.done("error")
        return error_response(500, event.error, kind="server_error")
    job.done("ok")
    text = "".join(parts)
    created = int(time.time())
    model = job.state.model_id
    if job.endpoint == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": event.finish_reason, "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": event.finish_reason, "logprobs": None}
        obj = "text_completion"
    return JSONResponse({"id": job.id, "object": obj, "created": created, "model": model, "choices": [choice],
                         "usage": job.usage()})


async def _stream(job: _Job, body: CompletionRequest | ChatRequest) -> AsyncIterator[str]:
    """Server-sent events: one chunk per piece of final text, then the finish reason, the
    usage if asked for, and ``[DONE]``. Cancelled (the client went away): the request is too."""
    created = int(time.time())
    chat = job.endpoint == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, role: bool = False) -> str:
        if chat:
            delta: dict[str, str] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, object] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        data = {"id": job.id, "object": obj, "created": created, "model": job.state.model_id, "choices": [choice]}
        if body.include_usage:
            data["usage"] = None
        return f"data: {json.dumps(data)}\n\n"

    outcome = "cancelled"
    try:
        if chat:
            yield chunk("", None, role=True)
        while True:
            event = await job.events.get()
            if event.error is not None:
                outcome = "error"
                yield f"data: {json.dumps({'error': {'message': event.error, 'type': 'server_error'}})}\n\n"
                break
            if event.text:
                yield chunk(event.text, None)
            if event.finished:
                yield chunk(None if chat else "", event.finish_reason)
                if body.include_usage:
                    data = {"id": job.id, "object": obj, "created": created, "model": job.state.model_id,
                            "choices": [], "usage": job.usage()}
                    yield f"data: {json.dumps(data)}\n\n"
                outcome = "ok"
                break
        yield "data: [DONE]\n\n"
    finally:
        if outcome == "cancelled":
            job.cancel()
        job.done(outcome)
