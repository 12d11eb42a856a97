"""Ctrl-C and SIGTERM: every verb stops with one line and exit 130 (SIGINT) or 143 (SIGTERM), no traceback.

`fivefold train` lets torch's elastic agent stop the workers (it catches the signal, terminates every worker
and raises SignalException); the launcher turns that into Interrupted, and the CLI names the step the run
was in and its newest complete checkpoint. A checkpoint whose save was cut off has no COMMIT marker, so it
is never taken as complete. In worker processes SIGINT terminates quietly, like SIGTERM (no traceback from
each worker when a terminal's Ctrl-C reaches the whole process group).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


class Interrupted(BaseException):
    """A signal asked fivefold to stop. A BaseException, like KeyboardInterrupt, so that no
    `except Exception` on the way swallows it."""

    def __init__(self, signum: int, line: str = "interrupted") -> None:
        super().__init__(line)
        self.signum = signum
        self.line = line

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


def _raise_interrupted(signum: int, frame: object) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block SIGTERM raises Interrupted (as SIGINT raises KeyboardInterrupt); then the previous
    handler is back. Only the main thread may set handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def quiet_sigint_in_worker() -> None:
    """In a worker process: SIGINT ends the process at once, as SIGTERM does, without Python's
    KeyboardInterrupt traceback. A terminal's Ctrl-C reaches every worker of the process group, and torch's
    agent passes the signal it caught on to the workers; either way the launcher reports the interrupt."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupted_line(last_finished_step: int | None, total_steps: int, checkpoint_dir: str | None,
                     newest_checkpoint: str | None) -> str:
    """'interrupted at step 37; newest complete checkpoint ck/step-00000036'."""
    running = min((last_finished_step or 0) + 1, total_steps)
    text = f"interrupted at step {running}"
    if checkpoint_dir is None:
        return text + "; no checkpoints (no --checkpoint-dir)"
    if newest_checkpoint is None:
        return text + f"; no complete checkpoint in {checkpoint_dir} yet"
    return text + f"; newest complete checkpoint {newest_checkpoint}"
