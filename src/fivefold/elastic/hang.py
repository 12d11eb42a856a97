"""Hung peers: every collective gets a timeout, and a timed-out collective ends the worker with one line.

`--collective-timeout S` becomes the timeout of the default process group AND of every group created
after it (runtime/mesh.init_distributed sets it, with a store per restart so a restarted incarnation never
reads the dead one's keys). With gloo a recv that waits longer raises "Timed out waiting ... ms"; with NCCL
the watchdog aborts the communicator after the timeout. Here: which exceptions are such timeouts, and the
one line that names the step and the rank.

Test-only knob: FIVEFOLD_HANG_AT="RANK:STEP" makes that rank stop participating (sleep forever) at the
start of STEP, in the first incarnation only (a restarted run does not hang again); runtime/knobs.py applies it.
"""

from __future__ import annotations

import os

from fivefold.errors import SpecError

HANG_ENV = "FIVEFOLD_HANG_AT"
current_step = 0  # the 1-based step this process is in, for the error line


def hang_point(text: str | None = None) -> tuple[int, int] | None:
    """'1:4' -> (rank 1, step 4); '' -> None."""
    text = os.environ.get(HANG_ENV, "") if text is None else text
    if not text.strip():
        return None
    rank, sep, step = text.partition(":")
    try:
        point = (int(rank), int(step))
    except ValueError:
        point = (-1, -1)
    if not sep or point[0] < 0 or point[1] < 1:
        raise SpecError(HANG_ENV, text, "write RANK:STEP, e.g. 1:4 (rank 1 stops at step 4)")
    return point


def note_step(step: int) -> None:
    """The step this process is in, for a timeout's error line."""
    global current_step
    current_step = step


def is_collective_timeout(exc: BaseException) -> bool:
    text = str(exc)
    # gloo: "Timed out waiting 5000ms for recv operation to complete"; NCCL's watchdog: "... timed out" /
    # "Watchdog caught collective operation timeout". Not gloo's "timed out connecting" (a dead peer).
    return isinstance(exc, RuntimeError) and ("Timed out waiting" in text or "collective operation timeout" in text)


def timeout_message(seconds: float, rank: int) -> str:
    return (f"collective timed out after {seconds:g} s (--collective-timeout) at step {current_step} on rank {rank}: "
            "a peer rank stopped participating (hung, deadlocked or far slower); raise --collective-timeout "
            "if it was only slow")
