"""What `simulate --serve` writes: a picture (batch size, KV blocks in use and queue length over time, one line
per replica) and a Chrome/Perfetto trace (one process per replica: its steps as bars, the same three counters).
The trace keeps the first MAX_TRACE_STEPS steps (a long stream has 10^5 or more); the picture draws every step."""

from __future__ import annotations

import json
from pathlib import Path

from fivefold.sim.serving import ServingSimResult

MAX_TRACE_STEPS = 50_000


def write_serving_trace(result: ServingSimResult, path: str | Path) -> Path:
    """Chrome trace JSON (microseconds): steps as complete events, counters per replica."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    events = [json.dumps({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"replica {r}"}})
              for r in range(result.replicas)]
    for step in result.steps[:MAX_TRACE_STEPS]:
        start = step.start_s * 1e6
        events.append(f'{{"ph":"X","pid":{step.replica},"tid":0,"ts":{start:.3f},'
                      f'"dur":{(step.end_s - step.start_s) * 1e6:.3f},'
                      f'"name":"{step.requests} requests, {step.tokens} tokens"}}')
        events.append(f'{{"ph":"C","pid":{step.replica},"ts":{start:.3f},"name":"scheduler",'
                      f'"args":{{"batch":{step.requests},"kv_blocks":{step.kv_blocks},"queued":{step.queued}}}}}')
    kept = min(len(result.steps), MAX_TRACE_STEPS)
    meta = json.dumps({"title": result.title, "steps": len(result.steps), "steps_in_trace": kept})
    path.write_text('{"traceEvents":[' + ",\n".join(events) + f'],"otherData":{meta}}}')
    return path


def write_serving_png(result: ServingSimResult, path: str | Path, dpi: int = 110) -> Path:
    """Three panels over time, one line per replica: requests in the step, KV blocks in use, requests queued."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(3, 1, figsize=(12, 8), sharex=True)
    for r in range(result.replicas):
        mine = [s for s in result.steps if s.replica == r]
        times = [s.start_s for s in mine]
        label = f"replica {r}"
        axes[0].step(times, [s.requests for s in mine], where="post", lw=0.8, label=label)
        axes[1].step(times, [s.kv_blocks for s in mine], where="post", lw=0.8, label=label)
        axes[2].step(times, [s.queued for s in mine], where="post", lw=0.8, label=label)
    capacity = min(result.kv_blocks) if result.kv_blocks else 0
    axes[1].axhline(capacity, color="grey", ls="--", lw=0.8)
    for ax, name in zip(axes, ("requests per step", f"KV blocks in use (of {capacity:,})", "requests queued")):
        ax.set_ylabel(name, fontsize=9)
        ax.grid(alpha=0.3)
    axes[2].set_xlabel("seconds")
    if result.replicas <= 8:
        axes[0].legend(fontsize=8, ncol=min(result.replicas, 8), loc="upper right")
    summary = result.to_dict()
    fig.suptitle(f"{result.title}\n{summary['requests']} requests, TTFT p90 {summary['ttft_s']['p90'] * 1e3:.0f} ms,"
                 f" TPOT p90 {summary['tpot_s']['p90'] * 1e3:.1f} ms, {summary['output_tokens_per_s']:,.0f} output "
                 f"tokens/s, {summary['preemptions']} preemptions", fontsize=10)
    fig.savefig(path, dpi=dpi, pil_kwargs={"compress_level": 1})
    plt.close(fig)
    return path
