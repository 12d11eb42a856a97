"""This machine's share for local worker processes: a free TCP port for their rendezvous, the intra-op
threads each gets, and how each one's memory allocator is set. Used by the training launcher
(runtime/launch.py) and the profiler (profile/workers.py), so a profile measures what a training rank gets.
Also the share of a core processes got while they wanted one (CpuShare), from the kernel's scheduler
statistics: on a shared machine it says how much of a timing the neighbours took."""

from __future__ import annotations

import ctypes
import os
import socket
import sys


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def threads_per_worker(workers: int) -> int:
    """Intra-op threads of each of `workers` CPU processes: OMP_NUM_THREADS when the user set it, else the
    cores shared out (at least one each)."""
    return int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // workers))


# glibc mallopt options and the values a training worker uses (bytes).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
ALLOCATOR_SETTINGS = {
    "MALLOC_MMAP_THRESHOLD_": (_M_MMAP_THRESHOLD, 32 << 20),  # glibc's largest: below it, blocks come from the heap
    "MALLOC_TRIM_THRESHOLD_": (_M_TRIM_THRESHOLD, 256 << 20),  # keep up to this much freed memory
    "MALLOC_TOP_PAD_": (_M_TOP_PAD, 64 << 20),  # grow the heap in steps of this much
}


def tune_allocator() -> list[str]:
    """Let this process keep the memory it frees, so that a step reuses the pages of the one before.

    A training step frees tens of MB at once (FSDP2's gathered weights and reduced gradients, the
    activations); glibc's defaults hand such a free top of the heap back to the kernel, and the next step
    takes a page fault for every 4 KiB it writes again: a 32 MiB copy into fresh memory runs at ~4 GB/s
    here against ~29 GB/s into reused memory, and `small-moe` dp2 ZeRO-1 spends ~60 ms a step on it. A
    MALLOC_*_ variable the user set wins over the value here. Returns the settings applied (none off
    glibc)."""
    if not sys.platform.startswith("linux"):
        return []
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return []
    applied = []
    for name, (option, value) in ALLOCATOR_SETTINGS.items():
        if name not in os.environ and mallopt(option, value) == 1:
            applied.append(name)
    return applied


def _schedstat(pid: int | str) -> tuple[int, int] | None:
    """(ns on a CPU, ns runnable but waiting for one) of a process so far (Linux /proc/PID/schedstat)."""
    try:
        running, waiting, _ = open(f"/proc/{pid}/schedstat").read().split()
        return int(running), int(waiting)
    except (OSError, ValueError):
        return None


class CpuShare:
    """Of the time `pids` (default: this process) were runnable from now on, the share they spent on a CPU:
    1.0 on an idle machine, about cores / runnable threads on a loaded one. None where the kernel keeps no
    scheduler statistics."""

    def __init__(self, pids: list[int] | None = None) -> None:
        self.pids: list[int | str] = list(pids) if pids else ["self"]
        self.start = {pid: _schedstat(pid) for pid in self.pids}

    def share(self) -> float | None:
        running = waiting = 0
        for pid in self.pids:
            now, then = _schedstat(pid), self.start.get(pid)
            if now is None or then is None:
                continue
            running += now[0] - then[0]
            waiting += now[1] - then[1]
        return running / (running + waiting) if running + waiting > 0 else None
