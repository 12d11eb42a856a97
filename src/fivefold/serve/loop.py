"""The engine's own thread inside `fivefold serve`: it owns the Engine (nothing else touches it), takes new
requests and aborts from the HTTP handlers through a locked inbox, steps while there is work, and stops on
request or when a worker dies (every pending request then ends with reason "error")."""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable

from fivefold.serve.engine import Engine, Request
from fivefold.serve.metrics import ServeMetrics

STEP_DELAY_ENV = "FIVEFOLD_SERVE_STEP_DELAY"  # test-only: seconds slept after each engine step (slow model)


class QueueFull(Exception):
    """More requests wait for a slot than --max-queue allows (HTTP 429)."""


class EngineLoop:
    def __init__(self, engine: Engine, max_queue: int, metrics: ServeMetrics,
                 on_failure: Callable[[str], None] = lambda message: None) -> None:
        self.engine, self.max_queue, self.metrics, self.on_failure = engine, max_queue, metrics, on_failure
        self.lock = threading.Lock()
        self.inbox: deque[tuple[str, object]] = deque()
        self.wake = threading.Event()
        self.stopping = False
        self.failure: str | None = None
        self.pending: dict[str, Request] = {}  # submitted, not finished (for failing them all at once)
        self.step_delay = float(os.environ.get(STEP_DELAY_ENV) or 0.0)
        self.thread = threading.Thread(target=self._run, name="fivefold-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, request: Request) -> None:
        """Queue a request (checked by the caller with engine.check); QueueFull when too many wait; RuntimeError
        after a worker died."""
        with self.lock:
            if self.failure is not None:
                raise RuntimeError(self.failure)
            waiting = self.engine.queued_requests + sum(kind == "add" for kind, _ in self.inbox)
            if waiting >= self.max_queue:
                raise QueueFull(f"{waiting} requests are waiting (--max-queue {self.max_queue})")
            self.pending[request.request_id] = request
            self.inbox.append(("add", request))
        self.wake.set()

    def abort(self, request_id: str) -> None:
        with self.lock:
            self.inbox.append(("abort", request_id))
        self.wake.set()

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=30.0)

    def _finished(self, request: Request) -> None:
        with self.lock:
            self.pending.pop(request.request_id, None)
        self.metrics.request_finished(request.finish_reason or "abort", request.timings)

    def _drain_inbox(self) -> None:
        with self.lock:
            commands, self.inbox = list(self.inbox), deque()
        for kind, item in commands:
            if kind == "add":
                finish = item.on_finish

                def on_finish(request: Request, finish=finish) -> None:
                    self._finished(request)
                    if finish is not None:
                        finish(request)

                item.on_finish = on_finish
                self.engine.add(item)
            else:
                self.engine.abort(item)

    def _run(self) -> None:
        try:
            while not self.stopping:
                self._drain_inbox()
                if not self.engine.busy:
                    self.wake.wait(timeout=0.5)
                    self.wake.clear()
                    continue
                before = self.engine.generated_tokens
                self.engine.step(wait=0.05)
                if self.engine.generated_tokens > before:
                    self.metrics.tokens(self.engine.generated_tokens - before)
                if self.step_delay:
                    time.sleep(self.step_delay)
        except Exception as exc:  # noqa: BLE001 - a dead worker (WorkerDied) or a bug: fail every request, stop
            message = str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__
            with self.lock:
                self.failure = message
                pending, self.pending = list(self.pending.values()), {}
            for request in pending:
                request.finish_reason = "error"
                if request.on_finish is not None:
                    request.on_finish(request)
            self.on_failure(message)
