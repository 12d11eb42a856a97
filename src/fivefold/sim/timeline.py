"""The picture of a simulated step: a Gantt chart of every pp rank above its memory curve.

Each rank gets a tall compute row (F, B or I/W, optimizer) and a thin communication row beneath it
(sends above, collectives below); white space is idle time. Matplotlib with the Agg backend, so it runs on
machines without a display.

Big plans: when any rank has more than AGGREGATE_ABOVE bars (2,000), one bar per action is far below a
pixel and only slows the drawing, so every rank is drawn as aggregated spans instead: its compute row as
merged busy spans (F, B, I and W together; the optimizer keeps its colour), its thin row as merged
communication spans (sends and collectives together); gaps narrower than one pixel (the step / 1,500) are
closed, so what is left white is idle time of at least a pixel. The Chrome trace (sim/trace.py) keeps
every action.
"""

from __future__ import annotations

from collections import Counter
from operator import itemgetter
from pathlib import Path

from fivefold.sim.engine import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, CONTEXT_EXCHANGE, EMBEDDING_SYNC, FORWARD,
                                 VOCAB_COLLECTIVES,
                                 GRAD_REDUCE, OPTIMIZER, PARAM_GATHER, SEND_ACTIVATION, SEND_GRADIENT, Event, SimResult)
from fivefold.sim.step_input import INNER_STEPS, OUTER_SYNC
from fivefold.spec.units import GIB

COLORS = {FORWARD: "#4C72B0", BACKWARD: "#DD8452", BACKWARD_INPUT: "#DD8452", BACKWARD_WEIGHT: "#55A868",
          OPTIMIZER: "#8172B3", SEND_ACTIVATION: "#937860", SEND_GRADIENT: "#DA8BC3", GRAD_REDUCE: "#C44E52",
          PARAM_GATHER: "#64B5CD", EMBEDDING_SYNC: "#8C8C8C", CONTEXT_EXCHANGE: "#CCB974",
          VOCAB_COLLECTIVES: "#2CA6A4", OUTER_SYNC: "#000000", INNER_STEPS: "#9DB3D4"}
LEGEND = {FORWARD: "forward", BACKWARD: "backward", BACKWARD_INPUT: "backward: input grad",
          BACKWARD_WEIGHT: "backward: weight grad", OPTIMIZER: "optimizer", SEND_ACTIVATION: "send activation",
          SEND_GRADIENT: "send gradient", GRAD_REDUCE: "gradient reduce (dp)", PARAM_GATHER: "parameter gather",
          EMBEDDING_SYNC: "tied-embedding all-reduce", CONTEXT_EXCHANGE: "context-parallel exchange (inside F/B)",
          VOCAB_COLLECTIVES: "vocabulary-parallel collectives (inside F/B)",
          OUTER_SYNC: "DiLoCo outer exchange (between groups)", INNER_STEPS: "DiLoCo: inner steps without exchange"}
AGGREGATE_ABOVE = 2000  # bars on one rank beyond which ranks are drawn as aggregated spans
PIXELS_ACROSS = 1500  # about the width of the time axis in pixels: gaps below step / this are closed
BUSY, COMM = "busy", "comm"
AGGREGATED_COLORS = {BUSY: "#5A7DAE", COMM: "#C44E52"}
AGGREGATED_LEGEND = {BUSY: "busy: F/B/I/W (aggregated)", COMM: "communication: sends and collectives (aggregated)"}
ROW_HEIGHT, COMM_HEIGHT = 0.62, 0.22  # in row units: compute bar, thin communication row


def _lighter(color: str, amount: float = 0.38) -> str:
    red, green, blue = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{int(c + (255 - c) * amount):02x}" for c in (red, green, blue))


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 2e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def _row_y(event: Event, top: float) -> tuple[float, float]:
    """(bottom, height) of an event's bar in a rank's row whose bottom is at `top`."""
    if event.lane == "compute":
        return top + 0.3, ROW_HEIGHT
    if event.peer >= 0:  # point-to-point sends: upper half of the thin row
        return top + 0.16, COMM_HEIGHT / 2
    return top + 0.04, COMM_HEIGHT / 2  # collectives: lower half


def merged_spans(spans: list[tuple[float, float]], gap: float) -> list[tuple[float, float]]:
    """Sorted (start, end) spans joined where they overlap or are less than `gap` apart."""
    merged: list[tuple[float, float]] = []
    low = high = 0.0
    for start, end in sorted(spans):
        if merged and start - high < gap:
            if end > high:
                high = end
                merged[-1] = (low, high)
        else:
            low, high = start, end
            merged.append((low, high))
    return merged


def _detailed_bars(result: SimResult, gantt) -> tuple[dict, list[str], bool]:
    """One bar per event: {(y, height, colour, lane): [(start, width)]}, kinds drawn, several stages."""
    ranks = len(result.ranks)
    compute_events = [e for e in result.events if e.lane == "compute"]
    local_index: dict[int, dict[int, int]] = {r.rank: {} for r in result.ranks}
    for event in compute_events:
        if event.stage >= 0:
            local_index[event.rank].setdefault(event.stage, 0)
    for stages in local_index.values():  # number stages on a rank in model order
        for position, stage in enumerate(sorted(stages)):
            stages[stage] = position
    label_bars = len(compute_events) <= 400
    scale, _ = _time_unit(result.step_time_s)
    bars: dict[tuple[float, float, str, str], list[tuple[float, float]]] = {}
    kinds: list[str] = []
    for event in result.events:
        y, height = _row_y(event, ranks - 1 - event.rank)  # rank 0 on top
        color = COLORS.get(event.kind, "#999999")
        if event.lane == "compute" and event.stage >= 0 and local_index[event.rank].get(event.stage, 0) % 2:
            color = _lighter(color)  # the second (fourth, ...) stage on a rank
        width = (event.end - event.start) * scale
        bars.setdefault((y, height, color, event.lane), []).append((event.start * scale, width))
        if event.kind not in kinds:
            kinds.append(event.kind)
        if (label_bars and event.lane == "compute" and event.micro_batch >= 0
                and width > result.step_time_s * scale / 90):
            gantt.text(event.start * scale + width / 2, y + height / 2, str(event.micro_batch), ha="center",
                       va="center", fontsize=6.5, color="white")
    return bars, kinds, any(len(stages) > 1 for stages in local_index.values())


def aggregated_bars(result: SimResult) -> dict:
    """Per rank: its busy and communication spans merged across gaps under a pixel (module docstring); the
    optimizer drawn over the busy span in its own colour."""
    ranks = len(result.ranks)
    scale, _ = _time_unit(result.step_time_s)
    gap = result.step_time_s / PIXELS_ACROSS
    bars: dict[tuple[float, float, str, str], list[tuple[float, float]]] = {}
    for rank in result.ranks:
        top = ranks - 1 - rank.rank
        for group, spans, y, height in ((BUSY, rank.busy_spans, top + 0.3, ROW_HEIGHT),
                                        (COMM, rank.comm_spans, top + 0.04, COMM_HEIGHT)):
            bars[y, height, AGGREGATED_COLORS[group], group] = [
                (start * scale, (end - start) * scale) for start, end in merged_spans(spans, gap)]
    for event in result.events:
        if event.kind == OPTIMIZER:
            y, height = _row_y(event, ranks - 1 - event.rank)
            bars.setdefault((y, height, COLORS[OPTIMIZER], OPTIMIZER), []).append(
                (event.start * scale, (event.end - event.start) * scale))
    return bars


def _draw_bars(gantt, bars: dict, outline: bool) -> None:
    """All bars of one colour as one compound path: a handful of artists however many bars."""
    import numpy as np
    from matplotlib.patches import PathPatch
    from matplotlib.path import Path as MplPath

    by_color: dict[tuple[str, bool], list[tuple[float, float, float, float]]] = {}
    for (y, height, color, lane), spans in bars.items():
        edged = outline and lane == "compute"
        by_color.setdefault((color, edged), []).extend((x, w, y, height) for x, w in spans)
    for (color, edged), boxes in by_color.items():
        x, w, y, h = np.asarray(boxes, dtype=float).T
        corners = np.stack([np.stack([x, y], 1), np.stack([x + w, y], 1), np.stack([x + w, y + h], 1),
                            np.stack([x, y + h], 1)], 1)
        gantt.add_artist(PathPatch(MplPath.make_compound_path_from_polys(corners), facecolor=color,  # no autoscale
                                  edgecolor="white" if edged else "none", linewidth=0.4 if edged else 0.0))


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
    # Rows shrink past 24 ranks so that the picture stays a picture (at most ~16 inches of rows).
    row_inches = min(0.62, 16.0 / max(ranks, 1))
    compact = row_inches < 0.4  # one-line labels in a smaller font
    height = 2.2 + row_inches * ranks + 2.4
    # Fixed margins in inches (title and legend above, axis labels below) instead of tight_layout, which
    # lays out every tick label once more before the picture is drawn.
    fig, (gantt, memory) = plt.subplots(2, 1, figsize=(14, height), sharex=True,
                                        gridspec_kw={"height_ratios": [row_inches * ranks + 0.6, 2.4]})
    fig.subplots_adjust(left=0.15 if compact else 0.12, right=0.99, top=1 - 1.0 / height, bottom=0.55 / height,
                        hspace=0.9 / (row_inches * ranks + 3.0))
    per_rank = Counter(map(itemgetter(0), result.events))  # bars per rank (Event.rank)
    aggregated = max(per_rank.values(), default=0) > AGGREGATE_ABOVE
    if aggregated:
        bars, several_stages = aggregated_bars(result), False
        legend = [Patch(facecolor=AGGREGATED_COLORS[k], label=AGGREGATED_LEGEND[k]) for k in AGGREGATED_COLORS]
        legend.append(Patch(facecolor=COLORS[OPTIMIZER], label=LEGEND[OPTIMIZER]))
    else:
        bars, kinds, several_stages = _detailed_bars(result, gantt)
        legend = [Patch(facecolor=COLORS[k], label=LEGEND[k]) for k in LEGEND if k in kinds]
    compute_bars = sum(len(spans) for (_, _, _, lane), spans in bars.items() if lane == "compute")
    _draw_bars(gantt, bars, outline=not aggregated and compute_bars <= 2000)
    gantt.set_yticks([(ranks - 1 - r.rank) + 0.5 for r in result.ranks])
    separator = ", " if compact else "\n"
    gantt.set_yticklabels([r.label.replace("\n", separator) + (
        f"{separator}busy {r.busy_s / result.step_time_s:.0%}" if result.step_time_s else "")
        for r in result.ranks], fontsize=6 if compact else 8)
    gantt.set_ylim(-0.1, ranks + 0.05)
    gantt.set_xlim(0, result.step_time_s * scale * 1.005)
    gantt.grid(axis="x", alpha=0.3)
    gantt.set_axisbelow(True)
    gantt.legend(handles=legend, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(legend), fontsize=8,
                 frameon=False)
    how = ("aggregated spans per rank: white = idle; every action is in the trace" if aggregated else
           "numbers on bars: micro-batch; thin rows: sends above, collectives below"
           + ("; lighter bars: a rank's second stage" if several_stages else ""))
    title = result.title or result.schedule
    span = (f"step {result.step_time_s * scale:.3g} {unit}" if not result.outer else  # DiLoCo: one outer cycle
            f"cycle {result.step_time_s * scale:.3g} {unit}, mean step {result.outer['step_time_s'] * scale:.3g} {unit}")
    gantt.set_title(f"{title}\n{span}, pipeline bubble "
                    f"{result.bubble_fraction:.1%}, {result.micro_batches} micro-batches ({how})", fontsize=10,
                    pad=28)
    _draw_memory(memory, result, scale, unit)
    # Fast zlib level: a big plan's picture compresses in a tenth of the default's time, ~20% larger; many
    # compact rows need fewer dots per inch to stay legible.
    fig.savefig(path, dpi=min(dpi, 100) if compact else dpi, pil_kwargs={"compress_level": 1})
    plt.close(fig)
    return path


def _draw_memory(memory, result: SimResult, scale: float, unit: str) -> None:
    """Each rank's memory over the step, its peak marked; beyond 8 ranks one legend line for the highest."""
    many = len(result.ranks) > 8
    for rank in result.ranks:
        times = [t * scale for t, _ in rank.memory] + [result.step_time_s * scale]
        levels = [b / GIB for _, b in rank.memory]
        levels.append(levels[-1])
        line, = memory.step(times, levels, where="post", linewidth=0.8 if many else 1.2,
                            label=f"{rank.label.splitlines()[0]} peak {rank.peak_memory_bytes / GIB:.3g} GiB")
        peak_index = max(range(len(levels)), key=levels.__getitem__)
        memory.plot([times[peak_index]], [levels[peak_index]], "o", color=line.get_color(), markersize=3)
    memory.set_ylabel("memory (GiB)")
    memory.set_xlabel(f"time ({unit})")
    low = min(b for r in result.ranks for _, b in r.memory) / GIB
    high = max(r.peak_memory_bytes for r in result.ranks) / GIB
    memory.set_ylim(max(0.0, low - 0.15 * (high - low + 1e-9)), high + 0.25 * (high - low + 1e-9))
    memory.grid(alpha=0.3)
    if many:
        top = max(result.ranks, key=lambda r: r.peak_memory_bytes)
        memory.set_title(f"{len(result.ranks)} ranks; highest peak {top.label.splitlines()[0]} "
                         f"{top.peak_memory_bytes / GIB:.3g} GiB", fontsize=8, loc="left")
    else:
        memory.legend(fontsize=7, ncol=min(4, len(result.ranks)), loc="best", framealpha=0.85)
