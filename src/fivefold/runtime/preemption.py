"""SIGTERM in a worker: a preempted or timed-out cluster job stops at the end of a step, with its work saved.

Slurm (and Kubernetes, and torch's elastic agent passing on the launcher's SIGTERM) sends SIGTERM and, a grace
period later, SIGKILL. Dying at once loses the save in flight and every step since the last checkpoint, so a
worker only notes the signal (TermWatch); the step's one bookkeeping all-reduce carries the note to every rank
(runtime/bookkeeping.py slot [3]), and after that step all ranks together:

    1. finish the checkpoint save in flight (its COMMIT is written),
    2. save the current step too when the newest checkpoint is more than --save-on-term-within seconds of
       steps behind (rank 0 decides, from its own step times, and tells the others),
    3. stop: the worker raises Interrupted, and the launcher prints today's line and exits 143.

Megatron-LM does the same with its --exit-signal-handler (a flag per rank, all-gathered every step); here the
flag rides on the all-reduce the step makes anyway, so a run that is never signalled pays nothing. What a step
costs and how long a save takes decide the grace a job needs: --term-grace (the launcher's wait for its
workers, and sbatch --signal=B:TERM@SECONDS).
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType


class TermWatch:
    """Notes SIGTERM instead of dying of it; `requested` is read once per step. Only the main thread may set
    a handler: elsewhere (a test calling train() in a thread) the watch stays off."""

    def __init__(self) -> None:
        self.requested = False
        self.at: float | None = None  # when it came (unix seconds)
        self.previous = None
        self.installed = False

    def install(self) -> TermWatch:
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self.note)
            self.installed = True
        return self

    def note(self, signum: int, frame: FrameType | None) -> None:
        if not self.requested:
            self.requested, self.at = True, time.time()

    def restore(self) -> None:
        if self.installed:
            signal.signal(signal.SIGTERM, self.previous if self.previous is not None else signal.SIG_DFL)
            self.installed = False


def should_save_on_term(step: int, newest_step: int, unsaved_seconds: float, threshold: float | None) -> bool:
    """Whether the run saves step `step` before stopping: saving is on (`threshold` is not None), the newest
    checkpoint (saved or in flight, or the one resumed from) is of an earlier step, and the steps since it took
    more than `threshold` seconds."""
    return threshold is not None and newest_step < step and unsaved_seconds > threshold


def term_line(step: int, finished: int | None, saved: bool, newest_step: int, unsaved_seconds: float,
              threshold: float | None) -> str:
    """Rank 0's account of what SIGTERM did, one line."""
    parts = [f"SIGTERM: stopping after step {step}"]
    if finished is not None:
        parts.append(f"finished the save of step {finished} in flight")
    if saved:
        parts.append(f"saved step {step} ({unsaved_seconds:.2f} s of steps after step {newest_step})")
    elif threshold is None:
        parts.append("no save on SIGTERM (--save-on-term-within off)")
    elif newest_step < step:
        parts.append(f"step {newest_step}'s checkpoint is {unsaved_seconds:.2f} s of steps behind, within "
                     f"--save-on-term-within {threshold:g}: not saving again")
    return "; ".join(parts)
