"""This machine's share for local worker processes: a free TCP port for their rendezvous, and the intra-op
threads each gets. Used by the training launcher (runtime/launch.py) and the profiler (profile/workers.py),
so a profile measures what a training rank gets."""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def threads_per_worker(workers: int) -> int:
    """Intra-op threads of each of `workers` CPU processes: OMP_NUM_THREADS when the user set it, else the
    cores shared out (at least one each)."""
    return int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // workers))
