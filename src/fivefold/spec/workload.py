"""Workload: the request stream a serving deployment is planned for (`plan/estimate/simulate --serve`).

Lengths are a number or `mean:std` (a lognormal with that mean and standard deviation, the shape request
lengths of chat traces follow), or a trace file (CSV or JSONL with `arrival_s`, `prompt_tokens`,
`output_tokens`). Arrivals: `--rate` requests/s (Poisson; `inf` = all at once, the offline throughput
benchmark of vLLM / TensorRT-LLM) or `--batch B` (B requests always in flight: a closed loop). Latency targets
`--ttft-slo` / `--tpot-slo` are p90 seconds. Validated on construction with one-line errors; no torch here.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from fivefold.errors import SpecError, require

TRACE_FIELDS = ("arrival_s", "prompt_tokens", "output_tokens")
MAX_TOKENS = 10_000_000


@dataclass(frozen=True)
class Length:
    """A token count: fixed (std 0) or lognormal with this mean and standard deviation."""

    mean: float
    std: float = 0.0

    def sample(self, rng: random.Random) -> int:
        if self.std <= 0:
            return max(1, round(self.mean))
        sigma2 = math.log(1.0 + (self.std / self.mean) ** 2)
        return max(1, round(rng.lognormvariate(math.log(self.mean) - sigma2 / 2, math.sqrt(sigma2))))

    def quantile(self, q: float) -> float:
        """The q-quantile (q=0.9: p90) of the distribution."""
        if self.std <= 0:
            return self.mean
        sigma2 = math.log(1.0 + (self.std / self.mean) ** 2)
        z = {0.5: 0.0, 0.9: 1.2816, 0.99: 2.3263}.get(q, 1.2816)
        return math.exp(math.log(self.mean) - sigma2 / 2 + z * math.sqrt(sigma2))

    def __str__(self) -> str:
        return f"{self.mean:g}" if self.std <= 0 else f"{self.mean:g}:{self.std:g}"


def parse_length(text: str | int | float, flag: str) -> Length:
    """`512` or `512:128` (mean:std, lognormal)."""
    mean_text, _, std_text = str(text).partition(":")
    try:
        mean = float(mean_text)
        std = float(std_text) if std_text else 0.0
    except ValueError:
        raise SpecError(flag, text, "write a token count, e.g. 512, or mean:std for a lognormal, e.g. 512:256")
    require(math.isfinite(mean) and 1 <= mean <= MAX_TOKENS and math.isfinite(std) and std >= 0, flag, text,
            f"the mean must be 1..{MAX_TOKENS} tokens and the std >= 0, e.g. 512:256")
    return Length(mean, std)


@dataclass(frozen=True)
class Request:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Workload:
    """Who asks what, how often, and how fast the answers must come."""

    prompt_len: Length = Length(512)
    output_len: Length = Length(128)
    rate: float | None = None  # requests/s over the whole deployment; inf = all at once
    batch: int | None = None  # or: this many requests always in flight (closed loop)
    ttft_slo: float | None = None  # p90 seconds to the first token
    tpot_slo: float | None = None  # p90 seconds per output token after the first
    trace: tuple[Request, ...] = ()  # replaces the lengths (and the arrivals, without --rate/--batch)
    num_requests: int = 1000  # requests in the stream (the simulator replays them; `inf` drains them)

    def __post_init__(self) -> None:
        require(self.rate is None or self.batch is None, "--batch", self.batch,
                "give either --rate or --batch, not both")
        if self.rate is not None:
            require(not math.isnan(self.rate) and self.rate > 0, "--rate", self.rate,
                    "must be a positive number of requests/s, or inf (all at once)")
        if self.batch is not None:
            require(isinstance(self.batch, int) and self.batch >= 1, "--batch", self.batch,
                    "must be a positive number of requests in flight")
        require(isinstance(self.num_requests, int) and 1 <= self.num_requests <= 10_000_000, "--requests",
                self.num_requests, "must be 1..10000000 requests")
        for name in ("ttft_slo", "tpot_slo"):
            value = getattr(self, name)
            if value is not None:
                require(math.isfinite(value) and value > 0, f"--{name.replace('_', '-')}", value,
                        "must be a positive number of seconds (p90 target)")

    @property
    def has_targets(self) -> bool:
        return self.ttft_slo is not None or self.tpot_slo is not None

    @property
    def mean_prompt(self) -> float:
        return (sum(r.prompt_tokens for r in self.trace) / len(self.trace)) if self.trace else self.prompt_len.mean

    @property
    def mean_output(self) -> float:
        return (sum(r.output_tokens for r in self.trace) / len(self.trace)) if self.trace else self.output_len.mean

    def quantile_prompt(self, q: float) -> float:
        return _quantile([r.prompt_tokens for r in self.trace], q) if self.trace else self.prompt_len.quantile(q)

    @property
    def offered_rate(self) -> float | None:
        """Requests/s the stream offers: --rate, or a trace's own pace, or None (closed loop or all at once)."""
        if self.rate is not None:
            return self.rate
        if self.trace and self.batch is None and len(self.trace) > 1:
            span = self.trace[-1].arrival_s - self.trace[0].arrival_s
            return (len(self.trace) - 1) / span if span > 0 else math.inf
        return None

    def requests(self, count: int, seed: int = 0) -> list[Request]:
        """`count` requests (a trace: its first `count`, cycled): arrivals from --rate (Poisson) or the trace;
        with --batch, every arrival is 0 and the simulator keeps B in flight."""
        rng = random.Random(seed)
        out: list[Request] = []
        clock = 0.0
        for index in range(count):
            if self.trace:
                base = self.trace[index % len(self.trace)]
                prompt, output = base.prompt_tokens, base.output_tokens
                arrival = base.arrival_s
            else:
                prompt, output = self.prompt_len.sample(rng), self.output_len.sample(rng)
                arrival = 0.0
            if self.rate is not None and math.isfinite(self.rate):
                clock += rng.expovariate(self.rate) if index else 0.0
                arrival = clock
            elif self.rate is not None or self.batch is not None:
                arrival = 0.0
            out.append(Request(arrival, prompt, output))
        return out

    def describe(self) -> str:
        lengths = (f"trace of {len(self.trace)} requests" if self.trace
                   else f"prompt {self.prompt_len} / output {self.output_len} tokens")
        arrivals = (f"{self.rate:g} req/s" if self.rate is not None and math.isfinite(self.rate)
                    else "all at once" if self.rate is not None
                    else f"{self.batch} in flight" if self.batch is not None
                    else "the trace's arrivals" if self.trace else "as fast as the deployment serves")
        targets = ", ".join(f"{name} p90 <= {value * 1e3:g} ms" for name, value in
                            (("TTFT", self.ttft_slo), ("TPOT", self.tpot_slo)) if value is not None)
        return f"{lengths}, {arrivals}" + (f"; {targets}" if targets else "")

    def to_dict(self) -> dict:
        if self.trace:  # the trace's lengths, not the flags' (which it replaces)
            return {"prompt_len": f"{self.mean_prompt:g}", "output_len": f"{self.mean_output:g}", "rate": self.rate,
                    "batch": self.batch, "ttft_slo": self.ttft_slo, "tpot_slo": self.tpot_slo,
                    "trace_requests": len(self.trace), "trace_rate": self.offered_rate}
        return {"prompt_len": str(self.prompt_len), "output_len": str(self.output_len), "rate": self.rate,
                "batch": self.batch, "ttft_slo": self.ttft_slo, "tpot_slo": self.tpot_slo,
                "trace_requests": len(self.trace)}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def load_trace(path: str | Path) -> tuple[Request, ...]:
    """A CSV (header row) or JSONL file with arrival_s, prompt_tokens, output_tokens per request."""
    file = Path(path)
    require(file.is_file(), "--trace", str(path), "no such file; give a CSV or JSONL file with "
            f"{', '.join(TRACE_FIELDS)}")
    text = file.read_text()
    if file.suffix.lower() in (".jsonl", ".json") or text.lstrip().startswith("{"):
        try:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise SpecError("--trace", str(path), f"line {exc.lineno}: not JSON ({exc.msg}); write one object "
                            f"per line with {', '.join(TRACE_FIELDS)}")
    else:
        rows = list(csv.DictReader(text.splitlines()))
    require(bool(rows), "--trace", str(path), f"holds no request; write rows with {', '.join(TRACE_FIELDS)}")
    requests = []
    for number, row in enumerate(rows, 1):
        require(isinstance(row, dict) and all(k in row for k in TRACE_FIELDS), "--trace", f"{path} row {number}",
                f"needs the fields {', '.join(TRACE_FIELDS)}")
        try:
            arrival, prompt, output = (float(row["arrival_s"]), int(float(row["prompt_tokens"])),
                                       int(float(row["output_tokens"])))
        except (TypeError, ValueError):
            raise SpecError("--trace", f"{path} row {number}", "arrival_s must be seconds and prompt_tokens, "
                            "output_tokens whole numbers")
        require(math.isfinite(arrival) and arrival >= 0 and prompt >= 1 and output >= 1, "--trace",
                f"{path} row {number}", "arrival_s must be >= 0 and both token counts >= 1")
        requests.append(Request(arrival, prompt, output))
    return tuple(sorted(requests, key=lambda r: r.arrival_s))


def parse_rate(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        raise SpecError("--rate", text, "write requests/s, e.g. 5, or inf (all at once)")
