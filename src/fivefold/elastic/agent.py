"""The launcher's view of failures: torch's elastic agent runs inside the launching process and reports
what it does as torchelastic metrics; a handler on them writes `detected` (the agent saw the worker
group fail: its monitor polls every `monitor_interval`) and `restarted` (stopping the group, a new
rendezvous and starting the new workers took this long) into RUN/events.jsonl.

Which rank failed: a rank that raised writes its own `error` event (runtime/launch.py); a process that
vanished without a word (SIGKILL, the OOM killer) is found at detection time as the rank whose PID
(RUN/pids/) no longer runs, while the agent has not yet stopped the others.
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.elastic import metrics

from fivefold.elastic.events import LAUNCHER, EventLog, process_alive, read_pids

METRIC_GROUP = "torchelastic"  # the group torch's agent puts its metrics in


class AgentWatch(metrics.MetricHandler):
    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = run_dir
        self.events = EventLog(run_dir, restart=LAUNCHER)
        self.failures = 0

    def emit(self, metric_data: metrics.MetricData) -> None:
        name = metric_data.name
        if name.startswith("workers.") and name.endswith((".failed", ".unhealthy")):
            dead = sorted(rank for rank, pid in read_pids(self.run_dir).items() if not process_alive(pid))
            self.events.write("detected", incarnation=self.failures, dead_ranks=dead)
            self.failures += 1
        elif name.endswith("_restart_workers.duration.ms"):
            self.events.write("restarted", agent_seconds=metric_data.value / 1e3)

    def __enter__(self) -> AgentWatch:
        metrics.configure(self, METRIC_GROUP)
        return self

    def __exit__(self, *exc) -> None:
        metrics.configure(metrics.NullMetricHandler(), METRIC_GROUP)
