"""SIGTERM in a worker: a preempted or timed-out cluster job stops at the end of a step, with its work saved.

Slurm (and Kubernetes, and torch's elastic agent passing on the launcher's SIGTERM) sends SIGTERM and, a grace
period later, SIGKILL. Dying at once loses the save in flight and every step since the last checkpoint, so a
worker only notes the signal (TermWatch; but see TERM_MARKER_ENV below: a SIGTERM that stops a worker because a
peer failed still ends it at once); the step's one bookkeeping all-reduce carries the note to every rank
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

import contextlib
import os
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Iterator

# Which SIGTERM means "stop with the work saved". torch's elastic agent sends its workers SIGTERM for two
# reasons: its own SIGTERM (a preemption, the time limit: stop gracefully) and a failed peer (stop now: a
# worker that tried to end its step would only wait for the dead or hung peer). fivefold's launchers
# (runtime/launch.py, elastic/torchrun.py) tell them apart: on their own SIGTERM they first create the file
# named by FIVEFOLD_TERM_MARKER, which their workers inherit. A worker whose launcher is fivefold's stops
# gracefully only when that file exists (it waits MARK_WAIT_S for it: Slurm may signal every process of the job
# at once), and otherwise ends at once; a worker of a plain torchrun (no marker) always stops gracefully.
TERM_MARKER_ENV = "FIVEFOLD_TERM_MARKER"
MARK_WAIT_S = 2.0
# Signals torch's agent handles in fivefold's launchers: SIGTERM is theirs (graceful_term_for_workers).
AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"


@contextlib.contextmanager
def graceful_term_for_workers() -> Iterator[None]:
    """In a launcher: SIGTERM marks the stop as graceful for the workers (the marker file), then stops torch's
    agent as its own handler does (SignalException: the agent passes SIGTERM on to the workers and waits for
    them). Workers started inside the block inherit the marker's path."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    handle, marker = tempfile.mkstemp(prefix="fivefold-term-")
    os.close(handle)
    os.unlink(marker)
    before = os.environ.get(TERM_MARKER_ENV)
    os.environ[TERM_MARKER_ENV] = marker

    def on_term(signum: int, frame: FrameType | None) -> None:
        Path(marker).write_text(f"{os.getpid()}\n")
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_term) if main else None
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        if before is None:
            os.environ.pop(TERM_MARKER_ENV, None)
        else:
            os.environ[TERM_MARKER_ENV] = before
        Path(marker).unlink(missing_ok=True)


class TermWatch:
    """Notes SIGTERM instead of dying of it (a graceful stop: `requested`, read once per step), or ends the
    worker at once when its launcher did not mark the stop as graceful (module comment above). The decision
    runs in a thread woken by the signal's wakeup byte, so it is taken even while the main thread waits inside
    a collective. Only the main thread may set handlers: elsewhere (a test calling train() in a thread) the
    watch stays off."""

    def __init__(self) -> None:
        self.requested = False
        self.at: float | None = None  # when the graceful stop was asked for (unix seconds)
        self.marker = os.environ.get(TERM_MARKER_ENV)
        self.previous = None
        self.installed = False
        self.wakeup: tuple[socket.socket, socket.socket] | None = None
        self.previous_fd = -1

    def install(self) -> TermWatch:
        if threading.current_thread() is not threading.main_thread():
            return self
        self.previous = signal.signal(signal.SIGTERM, self.note)
        self.installed = True
        if self.marker:
            reader, writer = socket.socketpair()
            writer.setblocking(False)
            self.previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            self.wakeup = (reader, writer)
            threading.Thread(target=self.decide, args=(reader,), name="fivefold-sigterm", daemon=True).start()
        return self

    def note(self, signum: int, frame: FrameType | None) -> None:
        """The Python handler (main thread). With a marker to check, the watching thread decides."""
        if not self.marker:
            self.grant()

    def grant(self) -> None:
        if not self.requested:
            self.requested, self.at = True, time.time()

    def decide(self, reader: socket.socket) -> None:
        while True:
            try:
                woken = reader.recv(64)
            except OSError:
                woken = b""
            if not woken:  # restore() closed the other end
                reader.close()
                return
            if signal.SIGTERM not in woken:
                continue
            if self.marked():
                self.grant()
            else:  # the agent stops this worker for another reason: do not wait for a step that cannot end
                os._exit(128 + signal.SIGTERM)

    def marked(self) -> bool:
        deadline = time.monotonic() + MARK_WAIT_S
        while True:
            if os.path.exists(self.marker or ""):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def restore(self) -> None:
        if not self.installed:
            return
        if self.wakeup is not None:
            signal.set_wakeup_fd(self.previous_fd)
            self.wakeup[1].close()  # the thread reads the end of the stream and closes its side
            self.wakeup = None
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
