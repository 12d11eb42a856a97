"""`fivefold report RUN` for a serving run: what `generate --metrics-file RUN/requests.jsonl` or `serve
--metrics-file RUN/requests.jsonl` recorded (serve/record.py) next to the prediction for the same requests: the
cost model's steady state (cost/serving_estimate.py: means and p90) and the simulator's replay of the requests
through the same scheduler (sim/serving.py: every percentile), both made by predict_trace. generate made it at
launch; a server's traffic is known only afterwards, so the report makes it now from the requests the server
recorded, at their recorded arrivals and lengths. Percentiles are taken as the simulator takes them (the value at
index int(q x n) of the sorted values), TPOT over the requests with more than one output token.

A folder is a serving run when it holds serve_run.json (or the file named is a requests file beside one). A
missing or malformed file stops with one `error: ...` line. No torch here."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from fivefold.errors import SpecError, require
from fivefold.report.compare import Figure, error_pct
from fivefold.report.load import read_jsonl
from fivefold.spec.cluster import ClusterSpec
from fivefold.spec.jsonfields import Fields
from fivefold.spec.model import ModelSpec
from fivefold.spec.serve import ServeLayout
from fivefold.spec.workload import Request

RUN_FILE = "serve_run.json"  # serve/record.py writes it (that module imports torch-free, but lives in serve/)
STEPS_FILE = "steps.jsonl"
REQUEST_FIELDS = ("arrival_s", "prompt_tokens", "output_tokens", "ttft_s", "tpot_s", "total_s")
STEP_FIELDS = ("replica", "submitted_s", "done_s", "requests", "tokens")


def serving_run_file(path: str | Path) -> Path | None:
    """serve_run.json of a serving run folder (or of the requests file named), else None."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    found = folder / RUN_FILE
    return found if found.is_file() else None


@dataclass
class ServingReport:
    run: str
    layout: str
    cluster: str
    requests: int
    figures: list[Figure]
    steps: dict  # measured steps: count, median seconds, mean requests and tokens, KV blocks in use at most
    cpu_share: dict  # of a core while runnable: the profile's probe, the run's engine and workers (local.CpuShare)
    notes: list[str] = field(default_factory=list)
    verb: str = "generate"  # which verb recorded the run (serve: the prediction is made by the report)

    def to_dict(self) -> dict:
        return {"run": self.run, "kind": "serving", "verb": self.verb, "layout": self.layout, "cluster": self.cluster,
                "requests": self.requests, **{f.key: f.to_dict() for f in self.figures}, "steps": self.steps,
                "cpu_share": self.cpu_share, "notes": self.notes}


def _read_lines(path: Path, what: str, required: tuple[str, ...]) -> list[dict]:
    rows = read_jsonl(path, what)
    for number, row in enumerate(rows, 1):
        missing = [name for name in required if name not in row]
        if missing:
            raise SpecError(f"{path}:{number}", ",".join(missing),
                            f"missing; the report reads the {what} `fivefold generate/serve --metrics-file` writes")
        fields = Fields(row, f"{path}:{number}")
        for name in required:
            if row[name] is not None:  # a 1-token request has no TPOT, an unfinished one no time
                fields.real(name, minimum=0)
    return rows


def load_serving_run(run_file: Path) -> tuple[dict, list[dict], list[dict]]:
    """(serve_run.json, requests, steps), checked."""
    try:
        run = json.loads(run_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise SpecError(str(run_file), "unreadable", f"not the JSON `fivefold generate/serve --metrics-file` "
                        f"writes ({exc})") from None
    served = isinstance(run, dict) and run.get("verb") == "serve"  # predicted by this report (replay_served)
    if not isinstance(run, dict) or "layout" not in run or not (served or isinstance(run.get("prediction"), dict)):
        raise SpecError(str(run_file), "prediction/layout", "missing; rerun `fivefold generate --metrics-file`")
    folder = run_file.parent
    requests_path = folder / str(run.get("requests_file", "requests.jsonl"))
    if not requests_path.is_file():
        raise SpecError("run", str(requests_path), "is missing: serve_run.json names it as this run's requests")
    requests = _read_lines(requests_path, "requests file", REQUEST_FIELDS)
    if not requests:
        raise SpecError("run", str(requests_path), "holds no request")
    steps_path = folder / STEPS_FILE
    steps = _read_lines(steps_path, "steps file", STEP_FIELDS) if steps_path.is_file() else []
    return run, requests, steps


def predict_trace(model: ModelSpec, cluster: ClusterSpec, layout: ServeLayout, trace: tuple[Request, ...],
                  all_at_once: bool = False) -> dict:
    """serve_run.json's workload and prediction for these requests on this layout and cluster: the cost model's
    steady state and the simulator's replay through the scheduler. `all_at_once`: every request arrives at 0
    (rate inf: generate --input, the offline case); else the trace's own arrivals."""
    from fivefold.cost.deployment import place
    from fivefold.cost.serving_estimate import estimate_serving
    from fivefold.sim.serving import simulate_serving
    from fivefold.spec.workload import Workload

    workload = Workload(trace=trace, num_requests=len(trace), rate=float("inf") if all_at_once else None)
    replicas = place(model, cluster, layout, kv_blocks=layout.limits.kv_blocks)
    estimate = estimate_serving(replicas, layout.limits, workload, layout.pp)
    simulated = simulate_serving(replicas, layout.limits, workload, layout.pp, record_steps=False)
    return {"workload": workload.to_dict(),
            "prediction": {"estimate": estimate.to_dict(), "simulated": simulated.to_dict()}}


def replay_served(run_file: Path, run: dict, requests: list[dict]) -> tuple[dict, list[str]]:
    """A server's prediction, made now (predict_trace): every recorded request that got a token, at its arrival
    (the first at 0) with its prompt and output tokens, on the recorded model, cluster and layout; and notes
    saying so."""
    from fivefold.spec.cluster import cluster_from_dict
    from fivefold.spec.model import model_from_dict
    from fivefold.spec.serve import layout_from_dict

    got = sorted((r for r in requests if r["output_tokens"] >= 1), key=lambda r: r["arrival_s"])
    if not got:
        raise SpecError("run", str(run_file.parent), "no recorded request got a token: nothing to predict")
    for key in ("model", "cluster"):
        require(isinstance(run.get(key), dict), f"{run_file}:{key}", run.get(key),
                "missing; rerun `fivefold serve --metrics-file`")
    try:
        model = model_from_dict(run["model"])
        cluster = cluster_from_dict(run["cluster"], "cluster")
        layout = layout_from_dict(run["layout"])
    except SpecError as exc:
        raise SpecError(f"{run_file}:{exc.field}", exc.value, exc.fix) from None
    first = got[0]["arrival_s"]
    trace = tuple(Request(r["arrival_s"] - first, int(r["prompt_tokens"]), int(r["output_tokens"])) for r in got)
    predicted = predict_trace(model, cluster, layout, trace)
    notes = [f"a server's traffic is known only afterwards: predicted now for the {len(got)} requests it recorded, "
             "at their recorded arrivals and with their prompt and output tokens"]
    aborted = sum(1 for r in got if r.get("finish_reason") == "abort")
    if aborted:
        notes.append(f"{aborted} requests were aborted by their client; replayed with the tokens they got")
    if len(got) < len(requests):
        notes.append(f"{len(requests) - len(got)} requests ended without a token (aborted or failed) and are left "
                     "out of the prediction")
    return predicted, notes


def percentile(values: list[float], q: float) -> float | None:
    """The simulator's percentile (sim/serving.ServingSimResult.percentiles)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def measured_summary(requests: list[dict]) -> dict:
    """TTFT and TPOT mean/p50/p90 and output tokens/s over the run (first arrival to last finish)."""
    ttft = [r["ttft_s"] for r in requests if r["ttft_s"] is not None]
    tpot = [r["tpot_s"] for r in requests if r["tpot_s"] is not None and r["output_tokens"] > 1]
    ends = [r["arrival_s"] + r["total_s"] for r in requests if r["total_s"] is not None]
    span = max(ends, default=0.0) - min(r["arrival_s"] for r in requests)
    output = sum(r["output_tokens"] for r in requests)

    def stats(values: list[float]) -> dict:
        return {"mean": sum(values) / len(values) if values else None, "p50": percentile(values, 0.5),
                "p90": percentile(values, 0.9)}

    return {"ttft_s": stats(ttft), "tpot_s": stats(tpot),
            "output_tokens_per_s": output / span if span > 0 else None}


def _step_summary(steps: list[dict]) -> dict:
    if not steps:
        return {}
    durations = sorted(s["done_s"] - s["submitted_s"] for s in steps)
    return {"count": len(steps), "median_s": durations[len(durations) // 2],
            "mean_requests": sum(s["requests"] for s in steps) / len(steps),
            "mean_tokens": sum(s["tokens"] for s in steps) / len(steps),
            "kv_blocks_in_use_max": max((s.get("kv_blocks_in_use", 0) for s in steps), default=0)}


def _cpu_shares(run: dict) -> dict:
    """The profile's serve_cpu_share (first group of the recorded cluster) and the run's (serve/record.py)."""
    def number(value: object) -> float | None:
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None

    try:
        host = run["cluster"]["group"][0]["calibration"]["host"]
        profile = number(host.get("serve_cpu_share"))
    except (KeyError, IndexError, TypeError, AttributeError):
        profile = None
    recorded = run.get("cpu_share") if isinstance(run.get("cpu_share"), dict) else {}
    return {"profile": profile, "engine": number(recorded.get("engine")), "workers": number(recorded.get("workers"))}


def _shares_text(shares: dict) -> str:
    return ", ".join(f"{shares[k]:.0%} ({k})" for k in ("engine", "workers") if shares.get(k) is not None)


def _layout_label(layout: dict) -> str:
    return (f"tp{layout.get('tp', 1)} pp{layout.get('pp', 1)} x{layout.get('replicas', 1)} replicas, "
            f"{layout.get('dtype', '?')}")


def serving_report(run_file: Path) -> ServingReport:
    """Predicted (estimate), simulated (replay) and measured figures of a serving run."""
    run, requests, steps = load_serving_run(run_file)
    measured = measured_summary(requests)
    notes = []
    if run.get("verb") == "serve":
        predicted, notes = replay_served(run_file, run, requests)
        run = {**run, **predicted}
    estimate = run["prediction"].get("estimate") or {}
    simulated = run["prediction"].get("simulated") or {}

    def get(table: dict, *keys: str) -> float | None:
        for key in keys:
            table = table.get(key) if isinstance(table, dict) else None  # type: ignore[assignment]
        return float(table) if isinstance(table, (int, float)) and math.isfinite(table) else None

    figures = []
    for metric, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT")):
        for stat in ("mean", "p50", "p90"):
            figures.append(Figure(f"{metric[:-2]}_{stat}_s", f"{label} {stat}", "s", get(estimate, metric, stat),
                                  get(simulated, metric, stat), measured[metric][stat]))
    figures.append(Figure("output_tokens_per_s", "output tokens/s", "tokens/s",
                          get(estimate, "output_tokens_per_s"), get(simulated, "output_tokens_per_s"),
                          measured["output_tokens_per_s"]))
    shares = _cpu_shares(run)
    ran = [v for k, v in shares.items() if k != "profile" and v is not None]
    if ran and min(ran) < 0.9:
        notes.append(f"while runnable the run got {_shares_text(shares)} of a core: on a shared machine the "
                     "neighbours took the rest, and a host-bound step takes about 1/share as long as the prediction "
                     "(a profiled CPU's engine costs are CPU seconds: a core of its own)")
    unfinished = sum(1 for r in requests if r["total_s"] is None)
    if unfinished:
        notes.append(f"{unfinished} requests did not finish; they count in TTFT only when they got a first token")
    return ServingReport(str(run_file.parent), _layout_label(run["layout"]), str(run.get("cluster_label", "?")),
                         len(requests), figures, _step_summary(steps), shares, notes, str(run.get("verb", "generate")))


def serving_renderables(report: ServingReport) -> list:
    """Rich renderables, as report/render.py's for a training run."""
    from fivefold.report.render import _value, figures_table

    out: list = [f"[bold]{report.run}[/bold]: serving, {report.layout}, {report.requests} requests; predicted for "
                 f"{report.cluster} by the cost model (steady state) and the simulator (the same requests "
                 f"replayed through the scheduler); measured: every request"]
    out.append(figures_table(report.figures))
    if report.steps:
        s = report.steps
        out.append(f"measured steps: {s['count']:,}, median {_value(s['median_s'], 's')}, "
                   f"{s['mean_requests']:.1f} requests and {s['mean_tokens']:.1f} tokens per step on average, "
                   f"at most {s['kv_blocks_in_use_max']} KV blocks in use")
    if any(v is not None for v in report.cpu_share.values()):
        profile = report.cpu_share.get("profile")
        out.append(f"share of a core while runnable: {_shares_text(report.cpu_share) or '-'}; profile probe "
                   f"{f'{profile:.0%}' if profile is not None else '-'}")
    for note in report.notes:
        out.append(f"note: {note}")
    return out
