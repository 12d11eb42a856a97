"""What GET /metrics shows, in Prometheus' text format: queued and running requests, KV blocks in use, TTFT and
time-per-output-token histograms, tokens/s. Written by hand (a counter, a histogram and a window, ~80 lines)
because prometheus_client is not a dependency of fivefold and the text format is a few lines."""

from __future__ import annotations

import threading
import time
from collections import deque

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_WINDOW_S = 10.0


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * len(buckets)
        self.total, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        for index, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[index] += 1
        self.total += value
        self.count += 1

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        out += [f'{self.name}_bucket{{le="{bound}"}} {count}' for bound, count in zip(self.buckets, self.counts)]
        out += [f'{self.name}_bucket{{le="+Inf"}} {self.count}', f"{self.name}_sum {self.total}",
                f"{self.name}_count {self.count}"]
        return out


class ServeMetrics:
    """Filled by the engine thread (finished requests, tokens), read by the HTTP thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ttft = Histogram("fivefold_time_to_first_token_seconds", "arrival to first generated token")
        self.tpot = Histogram("fivefold_time_per_output_token_seconds", "mean time between a request's tokens")
        self.finished: dict[str, int] = {}
        self.window: deque[tuple[float, int]] = deque()

    def tokens(self, count: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self.lock:
            self.window.append((now, count))
            while self.window and self.window[0][0] < now - RATE_WINDOW_S:
                self.window.popleft()

    def request_finished(self, reason: str, timings: dict) -> None:
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            if timings.get("ttft_s") is not None:
                self.ttft.observe(timings["ttft_s"])
            if timings.get("tpot_s") is not None:
                self.tpot.observe(timings["tpot_s"])

    def tokens_per_s(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self.lock:
            recent = [(t, n) for t, n in self.window if t >= now - RATE_WINDOW_S]
        return sum(n for _, n in recent) / RATE_WINDOW_S

    def render(self, gauges: dict[str, tuple[str, float]], counters: dict[str, tuple[str, float]]) -> str:
        lines: list[str] = []
        for name, (help_text, value) in gauges.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value}"]
        for name, (help_text, value) in counters.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
        with self.lock:
            lines += ["# HELP fivefold_requests_finished_total requests ended, by finish reason",
                      "# TYPE fivefold_requests_finished_total counter"]
            lines += [f'fivefold_requests_finished_total{{reason="{reason}"}} {count}'
                      for reason, count in sorted(self.finished.items())]
            lines += self.ttft.lines() + self.tpot.lines()
        return "\n".join(lines) + "\n"
