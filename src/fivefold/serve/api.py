"""The HTTP API (FastAPI): POST /v1/completions and /v1/chat/completions (whole or streamed as server-sent events),
GET /v1/models, /health and /metrics. Each request becomes an engine Request whose tokens come back from the
engine thread through an asyncio queue; a client that disconnects aborts its request, which frees its KV blocks.
The app's lifespan starts the engine thread and, at shutdown, stops it and closes the run record (--metrics-file:
every finished request is written as it finishes, serve/record.RunWriter)."""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from fivefold.errors import SpecError
from fivefold.serve.engine import Engine, Request
from fivefold.serve.loop import EngineLoop, QueueFull
from fivefold.serve.metrics import ServeMetrics
from fivefold.serve.protocol import ChatBody, CompletionBody, SamplingFields, error_body
from fivefold.serve.sampling import SamplingParams
from fivefold.serve.source import TextCodec


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind


@dataclass
class ServerState:
    engine: Engine
    loop: EngineLoop
    codec: TextCodec | None
    model_name: str
    metrics: ServeMetrics
    vocab: int
    worker_pids: list[int] = field(default_factory=list)
    run_writer: Any = None  # serve/record.RunWriter with --metrics-file: each finished request, each step
    counter: itertools.count = field(default_factory=lambda: itertools.count(1))
    created: int = field(default_factory=lambda: int(time.time()))

    def shutdown(self) -> None:
        """Stop the engine thread and close the run record: the lifespan's shutdown, and run_server's ending for
        a server that never got that far (the second call does nothing)."""
        if self.loop.thread.ident is not None:  # started
            self.loop.stop()
        if self.run_writer is not None:
            self.run_writer.close()


class Generation:
    """One request in flight: the engine thread's callbacks put events on an asyncio queue of the HTTP loop."""

    def __init__(self, state: ServerState, prompt_ids: list[int], body: SamplingFields, max_tokens: int,
                 prefix: str) -> None:
        self.state, self.body = state, body
        self.events: asyncio.Queue = asyncio.Queue()
        self.aio_loop = asyncio.get_running_loop()
        number = next(state.counter)
        self.id = f"{prefix}-{number}"
        self.stops = body.stop_strings()
        if self.stops and state.codec is None:
            raise ApiError(400, "stop strings need the model folder's tokenizer", "stop")
        # With a seed, the tokens depend on (seed, position) only: the same request gives the same answer.
        seed, key = (body.seed, 0) if body.seed is not None else (secrets.randbits(32), number)
        params = SamplingParams(temperature=body.temperature, top_p=body.top_p, seed=seed, key=key)
        self.request = Request(self.id, prompt_ids, max_tokens, params,
                               stop_check=self._stopped if self.stops else None,
                               on_token=self._on_token, on_finish=self._on_finish)
        self.done = False

    def _stopped(self, request: Request) -> bool:
        text = self.state.codec.decode(request.output_ids)
        return any(stop in text for stop in self.stops)

    def _on_token(self, request: Request, token: int) -> None:
        self.aio_loop.call_soon_threadsafe(self.events.put_nowait, "token")

    def _on_finish(self, request: Request) -> None:
        if self.state.run_writer is not None:
            self.state.run_writer.request(request)
        self.aio_loop.call_soon_threadsafe(self.events.put_nowait, "finish")

    def text(self) -> str:
        """The completion's text so far, cut before the first stop string."""
        if self.state.codec is None:
            return ""
        text = self.state.codec.decode(self.request.output_ids)
        for stop in self.stops:
            cut = text.find(stop)
            if cut >= 0:
                text = text[:cut]
        return text

    def usage(self) -> dict:
        prompt, completion = len(self.request.prompt_ids), len(self.request.output_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def start(self) -> None:
        self.request.arrival = self.state.engine.clock()  # now, not when the engine thread takes it (its TTFT)
        try:
            self.state.loop.submit(self.request)
        except QueueFull as exc:
            raise ApiError(429, f"the queue is full: {exc}; retry later", None, "rate_limit_exceeded") from None
        except RuntimeError as exc:
            raise ApiError(503, f"the model workers are gone: {exc}", None, "service_unavailable") from None

    async def next_event(self, http: HttpRequest | None = None) -> str:
        """"token" or "finish"; aborts the request when the client of a whole (unstreamed) answer has left."""
        while True:
            try:
                event = await asyncio.wait_for(self.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if http is not None and await http.is_disconnected():
                    self.abort()
                    raise asyncio.CancelledError from None
                continue
            if event == "finish":
                self.done = True
            return event

    def abort(self) -> None:
        if not self.done:
            self.state.loop.abort(self.id)
            self.done = True

    def failed(self) -> bool:
        return self.request.finish_reason == "error"


def _prompt_ids(state: ServerState, prompt) -> list[int]:
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise ApiError(400, "one prompt per request (n prompts are not batched into one call)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if state.codec is None:
            raise ApiError(400, "this model folder has no tokenizer; send the prompt as token ids", "prompt")
        return state.codec.encode(prompt)
    bad = [t for t in prompt if not 0 <= t < state.vocab]
    if bad:
        raise ApiError(400, f"token ids must be in [0, {state.vocab}), got {bad[:3]}", "prompt")
    return list(prompt)


def _max_tokens(state: ServerState, requested: int | None, prompt_tokens: int, default: int) -> int:
    if requested is None:
        room = state.engine.max_context - prompt_tokens if state.engine.max_context else default
        return max(1, min(default, room))
    return requested


def _check(state: ServerState, prompt_ids: list[int], max_tokens: int) -> None:
    try:
        state.engine.check(len(prompt_ids), max_tokens)
    except SpecError as exc:
        raise ApiError(400, str(exc), exc.field) from None


def _chunk(generation: Generation, kind: str, delta: str, finish: str | None, model: str) -> dict:
    if kind == "chat":
        choice = {"index": 0, "delta": {"role": "assistant", "content": delta} if delta or finish is None else {},
                  "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    chunk = {"id": generation.id, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
    if finish is not None:
        chunk["usage"] = generation.usage()
    return chunk


async def _stream(generation: Generation, kind: str, model: str) -> AsyncIterator[str]:
    sent = ""
    try:
        while True:
            event = await generation.next_event()
            if event == "finish" and generation.failed():
                error = error_body(f"the model workers are gone: {generation.state.loop.failure}", None,
                                   "service_unavailable", 503)
                yield f"data: {json.dumps(error)}\n\n"
                return
            text = generation.text()
            delta, sent = text[len(sent):], text
            finish = generation.request.finish_reason if event == "finish" else None
            if delta or finish is not None:
                yield f"data: {json.dumps(_chunk(generation, kind, delta, finish, model))}\n\n"
            if event == "finish":
                yield "data: [DONE]\n\n"
                return
    finally:
        generation.abort()  # the client left mid-stream (or the stream ended): free the KV blocks now


async def _whole(generation: Generation, http: HttpRequest, kind: str, model: str) -> JSONResponse:
    while await generation.next_event(http) != "finish":
        pass
    if generation.failed():
        raise ApiError(503, f"the model workers are gone: {generation.state.loop.failure}", None,
                       "service_unavailable")
    text, reason = generation.text(), generation.request.finish_reason
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason,
                  "token_ids": generation.request.output_ids}
    return JSONResponse({"id": generation.id, "object": "chat.completion" if kind == "chat" else "text_completion",
                         "created": int(time.time()), "model": model, "choices": [choice],
                         "usage": generation.usage()})


def make_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.loop.start()
        try:
            yield
        finally:
            state.shutdown()

    app = FastAPI(title="fivefold serve", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            param, message = "body", f"the body is not valid JSON ({first.get('msg', '')})"
        else:
            param = location[0] if location else "body"
            message = f"{'.'.join(location) or 'body'}: {first.get('msg', 'invalid')}"
        return JSONResponse(error_body(message, param, "invalid_request_error", 400), status_code=400)

    @app.exception_handler(ApiError)
    async def api_error(_: HttpRequest, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), exc.param, exc.kind, exc.status), status_code=exc.status)

    def check_model(name: str | None) -> None:
        if name is not None and name != state.model_name:
            raise ApiError(404, f"unknown model {name!r}; this server serves {state.model_name!r}", "model",
                           "not_found_error")

    async def respond(generation: Generation, http: HttpRequest, kind: str):
        generation.start()
        if generation.body.stream:
            return StreamingResponse(_stream(generation, kind, state.model_name), media_type="text/event-stream")
        return await _whole(generation, http, kind, state.model_name)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HttpRequest):
        check_model(body.model)
        prompt_ids = _prompt_ids(state, body.prompt)
        max_tokens = _max_tokens(state, body.max_tokens, len(prompt_ids), 16)
        _check(state, prompt_ids, max_tokens)
        return await respond(Generation(state, prompt_ids, body, max_tokens, "cmpl"), http, "text")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, http: HttpRequest):
        check_model(body.model)
        if state.codec is None:
            raise ApiError(400, "chat needs the model folder's tokenizer", "messages")
        prompt_ids = state.codec.chat([m.model_dump() for m in body.messages])
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = _max_tokens(state, requested, len(prompt_ids), 256)
        _check(state, prompt_ids, max_tokens)
        return await respond(Generation(state, prompt_ids, body, max_tokens, "chatcmpl"), http, "chat")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "fivefold", "max_model_len": state.engine.max_context}]}

    @app.get("/health")
    async def health():
        if state.loop.failure is not None:
            return JSONResponse({"status": "failed", "error": state.loop.failure}, status_code=503)
        return {"status": "ok", "workers": state.worker_pids}

    @app.get("/metrics")
    async def metrics():
        engine = state.engine
        gauges = {
            "fivefold_requests_queued": ("requests waiting for a slot", engine.queued_requests),
            "fivefold_requests_running": ("requests admitted (holding KV blocks)", engine.running_requests),
            "fivefold_kv_blocks_in_use": ("KV-cache blocks held by requests, all replicas", engine.kv_blocks_in_use),
            "fivefold_kv_blocks_total": ("KV-cache blocks, all replicas",
                                         engine.layout.limits.kv_blocks * engine.layout.replicas),
            "fivefold_generation_tokens_per_second": ("tokens generated per second over the last 10 s",
                                                      state.metrics.tokens_per_s()),
        }
        counters = {"fivefold_generation_tokens_total": ("tokens generated", engine.generated_tokens),
                    "fivefold_preemptions_total": ("requests preempted (recomputed)", engine.preemptions)}
        return PlainTextResponse(state.metrics.render(gauges, counters), media_type="text/plain; version=0.0.4")

    return app
