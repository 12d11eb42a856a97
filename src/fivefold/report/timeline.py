"""RUN/report-timeline.png: the simulated step above the measured one, on one time axis, in the
simulator's colours (fivefold.sim.timeline), one row per pipeline rank.

The bars are drawn the way sim/timeline.py draws them (compute row with micro-batch numbers, a rank's
second stage lighter, a thin row for communication beneath), with that module's colours and legend.
sim/timeline.py draws its Gantt chart inside write_timeline_png, on a figure of its own, so this module
draws the two charts itself on one figure with a shared x axis.
"""

from __future__ import annotations

from pathlib import Path

from fivefold.sim.engine import Event, SimResult
from fivefold.sim.timeline import COLORS, LEGEND, _lighter, _time_unit

PICTURE = "report-timeline.png"


def _gantt(axes, events: list[Event], labels: list[str], scale: float, x_max: float) -> set[str]:
    """Bars of `events` (rank = row, row 0 on top); returns the kinds drawn."""
    rows = len(labels)
    row_height, comm_height = 0.62, 0.22
    compute = [e for e in events if e.lane == "compute"]
    local_index: dict[int, dict[int, int]] = {row: {} for row in range(rows)}
    for event in compute:
        if event.stage >= 0:
            local_index[event.rank].setdefault(event.stage, 0)
    for stages in local_index.values():  # number stages on a rank in model order
        for position, stage in enumerate(sorted(stages)):
            stages[stage] = position
    bars: dict[tuple[float, float, str, str], list[tuple[float, float]]] = {}
    kinds: set[str] = set()
    for event in events:
        top = rows - 1 - event.rank
        if event.lane == "compute":
            y, height = top + 0.3, row_height
        elif event.peer >= 0:
            y, height = top + 0.16, comm_height / 2
        else:
            y, height = top + 0.04, comm_height / 2
        color = COLORS.get(event.kind, "#999999")
        if event.lane == "compute" and event.stage >= 0 and local_index[event.rank].get(event.stage, 0) % 2:
            color = _lighter(color)
        width = (event.end - event.start) * scale
        bars.setdefault((y, height, color, event.lane), []).append((event.start * scale, width))
        kinds.add(event.kind)
        if len(compute) <= 400 and event.lane == "compute" and event.micro_batch >= 0 and width > x_max * scale / 90:
            axes.text(event.start * scale + width / 2, y + height / 2, str(event.micro_batch), ha="center",
                      va="center", fontsize=6.5, color="white")
    for (y, height, color, lane), spans in bars.items():
        axes.broken_barh(spans, (y, height), facecolors=color, edgecolor="white" if lane == "compute" else "none",
                         linewidth=0.4)
    axes.set_yticks([rows - 1 - row + 0.5 for row in range(rows)])
    axes.set_yticklabels(labels, fontsize=8)
    axes.set_ylim(-0.1, rows + 0.05)
    axes.grid(axis="x", alpha=0.3)
    axes.set_axisbelow(True)
    return kinds


def write_comparison_png(simulated: SimResult, measured: list[Event], measured_length: float, labels: list[str],
                         path: str | Path, titles: tuple[str, str], dpi: int = 130) -> Path:
    """Simulated step (above) and measured step (below, `measured` events on `labels` rows) to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    x_max = max(simulated.step_time_s, measured_length)
    scale, unit = _time_unit(x_max)
    rows = len(labels)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(14, 2.4 + 1.24 * rows + 1.0), sharex=True)
    sim_labels = [rank.label.replace("\n", " ") for rank in simulated.ranks]
    kinds = _gantt(top, simulated.events, sim_labels, scale, x_max)
    kinds |= _gantt(bottom, measured, labels, scale, x_max)
    for axes, title, length in ((top, titles[0], simulated.step_time_s), (bottom, titles[1], measured_length)):
        axes.set_title(f"{title}: step {length * scale:.3g} {unit}", fontsize=10, loc="left")
        axes.axvline(length * scale, color="#333333", linewidth=0.8, linestyle="--")
    bottom.set_xlim(0, x_max * scale * 1.005)
    bottom.set_xlabel(f"time ({unit}) from the start of the step")
    order = [k for k in LEGEND if k in kinds]
    fig.legend(handles=[Patch(facecolor=COLORS[k], label=LEGEND[k]) for k in order], loc="upper center",
               ncol=len(order), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
