"""`fivefold serve`: check the flags, start the workers and the engine thread, then serve the API with uvicorn
until SIGTERM / Ctrl-C (uvicorn stops accepting connections and lets the requests in flight finish: exit 0) or
until a worker dies (the pending requests get 503, then one line and exit 1). With --metrics-file the run folder
is written while the server runs (serve/record.RunWriter) and closed at the end, however it ends."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fivefold.errors import require

if TYPE_CHECKING:
    from fivefold.serve.api import ServerState
    from fivefold.serve.source import ModelSource, TextCodec
    from fivefold.spec.serve import ServeLayout


def _listen(host: str, port: int) -> socket.socket:
    from fivefold.errors import SpecError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SpecError("--port", port, f"cannot listen on {host}:{port} ({exc.strerror}); choose a free port "
                                        "(0 picks one)") from None
    return sock


def run_server(args: argparse.Namespace) -> int:
    from fivefold.serve.options import layout_from_serve_args
    from fivefold.serve.record import check_record_flags, launch_record
    from fivefold.serve.source import open_codec, open_source

    require(0 <= args.port <= 65535, "--port", args.port, "must be in 0..65535")
    require(args.max_queue >= 1, "--max-queue", args.max_queue, "must be at least 1")
    check_record_flags(args)
    source = open_source(args.from_hf, args.checkpoint)
    layout = layout_from_serve_args(args, source.spec)
    codec = open_codec(source)
    from fivefold.serve.executor import make_executor
    from fivefold.serve.generate import print_torchrun_line
    from fivefold.serve.workers import WorkerDied

    if args.torchrun_worker and os.environ.get("RANK", "0") != "0":  # a worker rank: no server, only its share
        make_executor(source, layout, args.device, args.memory_window, torchrun=True)
        return 0
    launch = launch_record(args, source.spec, layout, "serve")  # a bad --cluster or --metrics-file: one line now
    print_torchrun_line("serve", args, layout)
    sock = _listen(args.host, args.port)  # before the workers start: a taken port is a one-line error

    import uvicorn

    from fivefold.serve.api import make_app

    try:
        executor = make_executor(source, layout, args.device, args.memory_window, args.torchrun_worker)
    except WorkerDied as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    server: uvicorn.Server | None = None

    def on_failure(message: str) -> None:
        if server is not None:
            server.should_exit = True

    state = serving_state(source, layout, codec, executor, args.max_queue, on_failure,
                          args.metrics_file, launch[0] if launch is not None else None)
    config = uvicorn.Config(make_app(state), log_level="warning", timeout_graceful_shutdown=None)
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    print(f"serving {source.name} (tp {layout.tp} x pp {layout.pp} x {layout.replicas} replicas) on "
          f"http://{host}:{port}/v1" + (f", recording to {args.metrics_file}" if launch is not None else ""),
          file=sys.stderr, flush=True)
    # uvicorn handles SIGTERM/SIGINT itself (graceful shutdown) and raises the signal again afterwards; the drain
    # is the intended ending here, so that re-raised signal must not turn into an "interrupted" exit.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])  # the app's lifespan starts the engine thread and stops it (api.make_app)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        state.shutdown()
        executor.close()
    if state.loop.failure is not None:
        print(f"error: {state.loop.failure}", file=sys.stderr)
        return 1
    return 0


def serving_state(source: ModelSource, layout: ServeLayout, codec: TextCodec | None, executor: Any, max_queue: int,
                  on_failure: Callable[[str], None] = lambda message: None, metrics_file: str | None = None,
                  run: dict | None = None) -> ServerState:
    """What the HTTP app serves (api.ServerState): the engine over `executor`, its thread (started by the app's
    lifespan) and, with --metrics-file, the run record (`run`: record.launch_record's), written from now on."""
    from fivefold.outputs import make_parents
    from fivefold.serve.api import ServerState
    from fivefold.serve.engine import Engine
    from fivefold.serve.loop import EngineLoop
    from fivefold.serve.metrics import ServeMetrics
    from fivefold.serve.record import RunWriter, StepRecorder

    pids = [process.pid for _, process in getattr(executor, "processes", [])]
    writer = recorder = None
    if metrics_file is not None and run is not None:
        recorder = executor = StepRecorder(executor)
    engine = Engine(executor, layout, source.eos_ids, source.spec.max_seq_len)
    if recorder is not None:
        recorder.attach(engine)
        writer = RunWriter(make_parents(metrics_file, "--metrics-file"), run, engine.clock(), recorder.cpu_share)
        recorder.on_step = writer.step  # a long-running server keeps no list of its steps
        recorder.started()
    metrics = ServeMetrics()
    loop = EngineLoop(engine, max_queue, metrics, on_failure)
    return ServerState(engine, loop, codec, source.name, metrics, source.spec.vocab, pids, writer)
