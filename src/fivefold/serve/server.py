"""`fivefold serve`: check the flags, start the workers and the engine thread, then serve the API with uvicorn
until SIGTERM / Ctrl-C (uvicorn stops accepting connections and lets the requests in flight finish: exit 0) or
until a worker dies (the pending requests get 503, then one line and exit 1)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys

from fivefold.errors import require


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
    from fivefold.serve.source import open_codec, open_source

    require(0 <= args.port <= 65535, "--port", args.port, "must be in 0..65535")
    require(args.max_queue >= 1, "--max-queue", args.max_queue, "must be at least 1")
    source = open_source(args.from_hf, args.checkpoint)
    layout = layout_from_serve_args(args, source.spec)
    codec = open_codec(source)
    from fivefold.serve.executor import make_executor
    from fivefold.serve.generate import print_torchrun_line
    from fivefold.serve.workers import WorkerDied

    if args.torchrun_worker and os.environ.get("RANK", "0") != "0":  # a worker rank: no server, only its share
        make_executor(source, layout, args.device, args.memory_window, torchrun=True)
        return 0
    print_torchrun_line("serve", args, layout)
    sock = _listen(args.host, args.port)  # before the workers start: a taken port is a one-line error

    import uvicorn

    from fivefold.serve.api import ServerState, make_app
    from fivefold.serve.engine import Engine
    from fivefold.serve.loop import EngineLoop
    from fivefold.serve.metrics import ServeMetrics

    try:
        executor = make_executor(source, layout, args.device, args.memory_window, args.torchrun_worker)
    except WorkerDied as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    engine = Engine(executor, layout, source.eos_ids, source.spec.max_seq_len)
    metrics = ServeMetrics()
    server: uvicorn.Server | None = None

    def on_failure(message: str) -> None:
        if server is not None:
            server.should_exit = True

    loop = EngineLoop(engine, args.max_queue, metrics, on_failure)
    pids = [process.pid for _, process in getattr(executor, "processes", [])]
    state = ServerState(engine, loop, codec, source.name, metrics, source.spec.vocab, pids)
    config = uvicorn.Config(make_app(state), log_level="warning", timeout_graceful_shutdown=None)
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    print(f"serving {source.name} (tp {layout.tp} x pp {layout.pp} x {layout.replicas} replicas) on "
          f"http://{host}:{port}/v1", file=sys.stderr, flush=True)
    loop.start()
    # uvicorn handles SIGTERM/SIGINT itself (graceful shutdown) and raises the signal again afterwards; the drain
    # is the intended ending here, so that re-raised signal must not turn into an "interrupted" exit.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        loop.stop()
        executor.close()
    if loop.failure is not None:
        print(f"error: {loop.failure}", file=sys.stderr)
        return 1
    return 0
