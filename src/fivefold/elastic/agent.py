"""The launcher's view of failures: torch's elastic agent runs inside the launching process and reports
what it does as torchelastic metrics; a handler on them writes `detected` (the agent saw the worker
group fail: its monitor polls every `monitor_interval`) and `restarted` (stopping the group, a new
rendezvous and starting the new workers took this long) into RUN/events.jsonl.

Which rank failed: a rank that raised writes its own `error` event (runtime/launch.py); a process that
vanished without a word (SIGKILL, the OOM killer) is the rank whose PID (RUN/pids/) stopped running first.
A background thread polls the PIDs, because by the time the agent reports the failure its peers may have
died too (of the closed sockets, or stopped by the agent), and then "dead now" no longer names the culprit.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from torch.distributed.elastic import metrics

from fivefold.elastic.events import LAUNCHER, EventLog, process_alive, read_pids

METRIC_GROUP = "torchelastic"  # the group torch's agent puts its metrics in


class AgentWatch(metrics.MetricHandler):
    POLL_SECONDS = 0.02

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = run_dir
        self.events = EventLog(run_dir, restart=LAUNCHER)
        self.failures = 0
        self.died: dict[int, float] = {}  # rank -> when its current PID was first seen dead
        self.watched: dict[int, int] = {}  # rank -> the PID those times belong to
        self.stopping = threading.Event()
        self.poller = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self.stopping.wait(self.POLL_SECONDS):
            for rank, pid in read_pids(self.run_dir).items():
                if self.watched.get(rank) != pid:  # a new incarnation wrote a new PID
                    self.watched[rank] = pid
                    self.died.pop(rank, None)
                if rank not in self.died and not process_alive(pid):
                    self.died[rank] = time.monotonic()

    def emit(self, metric_data: metrics.MetricData) -> None:
        name = metric_data.name
        if name.startswith("workers.") and name.endswith((".failed", ".unhealthy")):
            now = time.monotonic()
            for rank, pid in read_pids(self.run_dir).items():
                if rank not in self.died and not process_alive(pid):
                    self.died[rank] = now
            dead = sorted(self.died, key=lambda rank: (self.died[rank], rank))  # first to die first
            self.events.write("detected", incarnation=self.failures, dead_ranks=dead)
            self.failures += 1
        elif name.endswith("_restart_workers.duration.ms"):
            self.events.write("restarted", agent_seconds=metric_data.value / 1e3)

    def __enter__(self) -> AgentWatch:
        metrics.configure(self, METRIC_GROUP)
        self.poller.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.poller.join(timeout=1)
        metrics.configure(metrics.NullMetricHandler(), METRIC_GROUP)
