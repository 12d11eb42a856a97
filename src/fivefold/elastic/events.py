"""The run's memory across restarts: RUN/events.jsonl and RUN/pids/.

A restarted worker is a new process, and the launcher only sees the workers from outside, so whatever
the recovery report needs (when a worker started, when it had reloaded its checkpoint, which error a
rank raised, when the agent noticed a failure) is appended as one JSON line per event to
RUN/events.jsonl, by rank 0 of each worker incarnation and by the launcher. Each line has `kind`,
`time` (unix seconds) and `restart` (TORCHELASTIC_RESTART_COUNT of the incarnation, -1 = launcher).

Each worker also writes its PID to RUN/pids/rank{r}: the launcher uses them to tell which rank died
when a process vanished without an error (SIGKILL, the OOM killer), and tests use them to kill one.
No torch import here: the launcher and the report read these files without PyTorch.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

EVENTS_FILE = "events.jsonl"
PIDS_DIR = "pids"
LAUNCHER = -1  # the `restart` of events the launcher writes


def restart_count() -> int:
    """How many times the elastic agent has restarted this worker group (0 in the first incarnation)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def global_rank() -> int:
    return int(os.environ.get("RANK", "0"))


class EventLog:
    """Appends events to RUN/events.jsonl; does nothing without a run folder."""

    def __init__(self, run_dir: str | Path | None, restart: int | None = None) -> None:
        self.path = Path(run_dir) / EVENTS_FILE if run_dir else None
        self.restart = restart_count() if restart is None else restart
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, kind: str, **fields) -> dict:
        event = {"kind": kind, "time": time.time(), "restart": self.restart, **fields}
        if self.path is not None:
            # One write call per line in append mode: lines from several processes do not interleave.
            with open(self.path, "a") as handle:
                handle.write(json.dumps(event, default=str) + "\n")
        return event


def read_events(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / EVENTS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_pid(run_dir: str | Path | None, rank: int) -> None:
    if run_dir:
        folder = Path(run_dir) / PIDS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{rank}").write_text(f"{os.getpid()}\n")


def read_pids(run_dir: str | Path) -> dict[int, int]:
    """rank -> PID of the newest incarnation's workers."""
    folder = Path(run_dir) / PIDS_DIR
    pids = {}
    for file in folder.glob("rank*") if folder.is_dir() else []:
        try:
            pids[int(file.name[4:])] = int(file.read_text().strip())
        except ValueError:
            continue
    return pids


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) counts as dead
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True
