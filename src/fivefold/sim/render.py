"""Terminal output of `fivefold simulate` (rich; imported by the CLI only)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fivefold.spec.units import GIB

if TYPE_CHECKING:
    from fivefold.sim.engine import SimResult


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g} ms"


def simulate_renderables(result: SimResult, estimate_step_time_s: float | None, trace_path: Path,
                         png_path: Path) -> list:
    """Title, step time (against the estimate's unless a what-if changed the stages), per-rank table,
    and where the trace and picture went. Strings are printed with soft wrap."""
    from rich.table import Table

    compared = "" if estimate_step_time_s is None else f" (estimate: {_ms(estimate_step_time_s)})"
    lines: list = [f"[bold]{result.title}[/bold]"]
    outer = result.outer
    if outer:  # DiLoCo (sim/diloco.py): one outer cycle; the estimate is of its mean step
        lines += [f"mean step over the cycle {_ms(outer['step_time_s'])}{compared}: inner step "
                  f"{_ms(outer['inner_step_s'])} + {_ms(outer['exposed_per_step_s'])} exposed outer exchange; "
                  f"steps 1-{outer['steps_drawn']} drawn in {_ms(result.step_time_s)}",
                  f"outer exchange: {outer['fragments']} fragment(s) per {outer['sync_every']} steps, each "
                  f"{outer['fragment_bytes_per_rank'] / 1e6:,.2f} MB sent per rank in {_ms(outer['fragment_exchange_s'])} "
                  f"over the link between the {outer['link_ranks']} groups ({outer['link_gbit_s']:.3g} Gb/s per rank)"]
    else:
        lines.append(f"step {_ms(result.step_time_s)}{compared}, pipeline {_ms(result.pipeline_time_s)}")
    lines.append(f"{result.schedule}, {result.micro_batches} micro-batches, pipeline bubble "
                 f"{result.bubble_fraction:.1%} of the busiest rank's work")
    table = Table(box=None, pad_edge=False)
    for column in ("rank", "busy", "comm (exposed)", "idle", "bubble", "peak memory"):
        table.add_column(column, justify="left" if column == "rank" else "right")
    for rank in result.ranks:
        table.add_row(rank.label.replace("\n", " "), f"{rank.busy_s / result.step_time_s:.0%}",
                      f"{rank.exposed_comm_s / result.step_time_s:.0%}", f"{rank.idle_s / result.step_time_s:.0%}",
                      f"{rank.bubble_fraction:.1%}", f"{rank.peak_memory_bytes / GIB:.3g} GiB")
    return [*lines, table, f"wrote {trace_path} (open in https://ui.perfetto.dev)", f"wrote {png_path}"]
