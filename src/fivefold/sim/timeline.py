"""The picture of a simulated step: a Gantt chart of every pp rank above its memory curve.

Each rank gets a tall compute row (F, B or I/W, optimizer) and a thin communication row beneath it
(sends, gradient reduction, FSDP gathers); white space is idle time. Matplotlib with the Agg backend, so
it runs on machines without a display.
"""

from __future__ import annotations

from pathlib import Path

from fivefold.sim.engine import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, EMBEDDING_SYNC, FORWARD, GRAD_REDUCE,
                                 OPTIMIZER, PARAM_GATHER, SEND_ACTIVATION, SEND_GRADIENT, SimResult)

GIB = 2**30
COLORS = {FORWARD: "#4C72B0", BACKWARD: "#DD8452", BACKWARD_INPUT: "#DD8452", BACKWARD_WEIGHT: "#55A868",
          OPTIMIZER: "#8172B3", SEND_ACTIVATION: "#937860", SEND_GRADIENT: "#DA8BC3", GRAD_REDUCE: "#C44E52",
          PARAM_GATHER: "#64B5CD", EMBEDDING_SYNC: "#8C8C8C"}
LEGEND = {FORWARD: "forward", BACKWARD: "backward", BACKWARD_INPUT: "backward: input grad",
          BACKWARD_WEIGHT: "backward: weight grad", OPTIMIZER: "optimizer", SEND_ACTIVATION: "send activation",
          SEND_GRADIENT: "send gradient", GRAD_REDUCE: "gradient reduce (dp)", PARAM_GATHER: "parameter gather",
          EMBEDDING_SYNC: "tied-embedding all-reduce"}


def _lighter(color: str, amount: float = 0.38) -> str:
    red, green, blue = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{int(c + (255 - c) * amount):02x}" for c in (red, green, blue))


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 2e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def write_timeline_png(result: SimResult, path: str | Path, dpi: int = 130) -> Path:
    """Draw `result` to a PNG at `path`: Gantt chart of all ranks on top, memory per rank below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    scale, unit = _time_unit(result.step_time_s)
    ranks = len(result.ranks)
    fig_height = 2.2 + 0.62 * ranks + 2.4
    fig, (gantt, memory) = plt.subplots(2, 1, figsize=(14, fig_height), sharex=True,
                                        gridspec_kw={"height_ratios": [0.62 * ranks + 0.6, 2.4]})
    row_height, comm_height = 0.62, 0.22
    used_kinds: list[str] = []
    compute_events = [e for e in result.events if e.lane == "compute"]
    local_index: dict[int, dict[int, int]] = {r.rank: {} for r in result.ranks}
    for event in compute_events:
        if event.stage >= 0:
            stages = local_index[event.rank]
            stages.setdefault(event.stage, len(stages))
    for stages in local_index.values():  # number stages on a rank in model order
        for position, stage in enumerate(sorted(stages)):
            stages[stage] = position
    several_stages = any(len(stages) > 1 for stages in local_index.values())
    label_bars = len(compute_events) <= 400
    bars: dict[tuple[float, float, str, str], list[tuple[float, float]]] = {}
    for event in result.events:
        top = (ranks - 1 - event.rank) * 1.0  # rank 0 on top
        if event.lane == "compute":
            y, height = top + 0.3, row_height
        elif event.peer >= 0:  # point-to-point sends: upper half of the thin row
            y, height = top + 0.16, comm_height / 2
        else:  # collectives: lower half
            y, height = top + 0.04, comm_height / 2
        color = COLORS.get(event.kind, "#999999")
        if event.lane == "compute" and event.stage >= 0 and local_index[event.rank].get(event.stage, 0) % 2:
            color = _lighter(color)  # the second (fourth, ...) stage on a rank
        width = (event.end - event.start) * scale
        bars.setdefault((y, height, color, event.lane), []).append((event.start * scale, width))
        if event.kind not in used_kinds:
            used_kinds.append(event.kind)
        if (label_bars and event.lane == "compute" and event.micro_batch >= 0
                and width > result.step_time_s * scale / 90):
            gantt.text(event.start * scale + width / 2, y + height / 2, str(event.micro_batch), ha="center",
                       va="center", fontsize=6.5, color="white")
    for (y, height, color, lane), spans in bars.items():  # one call per row and colour: fast for big plans
        gantt.broken_barh(spans, (y, height), facecolors=color, edgecolor="white" if lane == "compute" else "none",
                          linewidth=0.4 if len(compute_events) <= 2000 else 0.0)
    gantt.set_yticks([(ranks - 1 - r.rank) + 0.5 for r in result.ranks])
    gantt.set_yticklabels([f"{r.label}\nbusy {r.busy_s / result.step_time_s:.0%}" if result.step_time_s else r.label
                           for r in result.ranks], fontsize=8)
    gantt.set_ylim(-0.1, ranks + 0.05)
    gantt.set_xlim(0, result.step_time_s * scale * 1.005)
    gantt.grid(axis="x", alpha=0.3)
    gantt.set_axisbelow(True)
    order = [k for k in LEGEND if k in used_kinds]
    gantt.legend(handles=[Patch(facecolor=COLORS[k], label=LEGEND[k]) for k in order], loc="lower center",
                 bbox_to_anchor=(0.5, 1.0), ncol=len(order), fontsize=8, frameon=False)
    title = result.title or result.schedule
    gantt.set_title(f"{title}\nstep {result.step_time_s * scale:.3g} {unit}, pipeline bubble "
                    f"{result.bubble_fraction:.1%}, {result.micro_batches} micro-batches "
                    f"(numbers on bars: micro-batch; thin rows: sends above, collectives below"
                    + ("; lighter bars: a rank's second stage" if several_stages else "") + ")", fontsize=10, pad=28)

    for rank in result.ranks:
        times = [t * scale for t, _ in rank.memory] + [result.step_time_s * scale]
        levels = [b / GIB for _, b in rank.memory]
        levels.append(levels[-1])
        line, = memory.step(times, levels, where="post", linewidth=1.2,
                            label=f"{rank.label.splitlines()[0]} peak {rank.peak_memory_bytes / GIB:.3g} GiB")
        peak_index = max(range(len(levels)), key=levels.__getitem__)
        memory.plot([times[peak_index]], [levels[peak_index]], "o", color=line.get_color(), markersize=3)
    memory.set_ylabel("memory (GiB)")
    memory.set_xlabel(f"time ({unit})")
    low = min(b for r in result.ranks for _, b in r.memory) / GIB
    high = max(r.peak_memory_bytes for r in result.ranks) / GIB
    memory.set_ylim(max(0.0, low - 0.15 * (high - low + 1e-9)), high + 0.25 * (high - low + 1e-9))
    memory.grid(alpha=0.3)
    memory.legend(fontsize=7, ncol=min(4, ranks), loc="best", framealpha=0.85)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
