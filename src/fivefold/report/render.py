"""The tables `fivefold report` prints: figures, per rank, where the step goes, largest sources of error."""

from __future__ import annotations

from typing import Any

from fivefold.report.compare import SOURCES_SHOWN, Report, error_pct


def seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1:
        return f"{value:.3g} s"
    if abs(value) >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    return f"{value * 1e6:.3g} µs"


def figures_table(figures: Any) -> Any:
    """Predicted, simulated and measured of each figure with both errors: the table of a training run's and a
    serving run's report."""
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for column in ("", "predicted", "simulated", "measured", "error", "sim. error"):
        table.add_column(column, justify="left" if not column else "right")
    for figure in figures:
        table.add_row(figure.name, _value(figure.predicted, figure.unit), _value(figure.simulated, figure.unit),
                      _value(figure.measured, figure.unit), _error(error_pct(figure.predicted, figure.measured)),
                      _error(error_pct(figure.simulated, figure.measured)))
    return table


def _value(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return seconds(value)
    if unit == "tokens/s":
        return f"{value:,.0f}"
    if unit == "%":
        return f"{value:.3g}%"
    return f"{value:.3g} {unit}"


def _error(pct: float | None) -> str:
    if pct is None:
        return "-"
    colour = "green" if abs(pct) <= 10 else "yellow" if abs(pct) <= 30 else "red"
    return f"[{colour}]{pct:+.0f}%[/{colour}]"


def report_renderables(report: Report) -> list[Any]:
    """Rich renderables, top to bottom."""
    from rich.table import Table

    out: list[Any] = []
    steps = report.measured_steps
    out.append(f"[bold]{report.run}[/bold]: {report.plan}; predicted by the cost model (stack {report.stack}) and "
               f"the simulator; measured: median of steps {steps[0]}-{steps[-1]} (first {report.warmup_steps} "
               f"left out as warm-up)")
    out.append(figures_table(report.figures))

    ranks = Table(title="per rank", title_justify="left", box=None, pad_edge=False)
    for column in ("rank", "pp dp cp tp", "memory predicted", "measured", "error", "own step measured", "error"):
        ranks.add_column(column, justify="left" if column.startswith(("rank", "pp")) else "right")
    for row in report.ranks:
        memory, own = row["memory_gib"], row["step_time_s"]
        coords = " ".join(str(row["coords"][d]) for d in ("pp", "dp", "cp", "tp"))
        ranks.add_row(str(row["rank"]), coords, _value(memory["predicted"], "GiB"), _value(memory["measured"], "GiB"),
                      _error(memory["error_pct"]), seconds(own["measured"]), _error(own["error_pct"]))
    out.append(ranks)

    if report.breakdown:
        parts = Table(title="where the step goes (busiest pipeline rank)", title_justify="left", box=None,
                      pad_edge=False)
        for column in ("part", "predicted", "simulated", "measured"):
            parts.add_column(column, justify="left" if column == "part" else "right")
        totals = {k: sum(p[k] or 0.0 for p in report.breakdown) for k in ("predicted_s", "simulated_s", "measured_s")}

        def share(part: dict, key: str) -> str:
            if part[key] is None:
                return "-"
            return f"{seconds(part[key])} ({part[key] / totals[key]:.0%})" if totals[key] else seconds(part[key])
        for part in report.breakdown:
            parts.add_row(part["name"], share(part, "predicted_s"), share(part, "simulated_s"),
                          share(part, "measured_s"))
        out.append(parts)

    lines = ["[bold]largest sources of error[/bold] (seconds per step, predicted - measured):"]
    for number, source in enumerate(report.sources[:SOURCES_SHOWN], 1):
        where = f" on pp{source.pp_rank} (rank {source.rank})" if report.traced_steps else ""
        each = ""
        if source.count > 1:
            each = (f" ({source.count} x {seconds(source.predicted_s / source.count)} vs "
                    f"{source.count} x {seconds(source.measured_s / source.count)})")
        lines.append(f"  {number}. {source.what}{where}: predicted {seconds(source.predicted_s)}, measured "
                     f"{seconds(source.measured_s)}: {'+' if source.error_s >= 0 else '-'}"
                     f"{seconds(abs(source.error_s))}{each}")
    out.append("\n".join(lines))
    if report.moe:
        moe = report.moe
        out.append(f"[bold]mixture of experts[/bold]: auxiliary loss {moe['aux_loss_median']:.4g} (median; last step "
                   f"{moe['aux_loss_last']:.4g}); expert load, tokens of the busiest expert / mean over experts "
                   f"(worst layer): median {moe['expert_load_max_over_mean_median']:.3g}, worst step "
                   f"{moe['expert_load_max_over_mean_worst']:.3g} (1 = balanced)"
                   + (f"; busiest ep rank's tokens / mean: median {moe['expert_rank_imbalance_median']:.3g}"
                      if moe.get("expert_rank_imbalance_median") is not None else "")
                   + (f"; experts ran as {'grouped GEMMs' if moe['expert_gemm'] == 'grouped' else 'a GEMM per expert'}"
                      if moe.get("expert_gemm") else ""))
        for collapse in moe.get("collapses", []):
            out.append(f"expert collapse: MoE layer {collapse['layer']} sent every token to expert {collapse['expert']} "
                       f"for {collapse['steps']} steps from step {collapse['since_step']} (the run's events)")
    for note in report.notes:
        out.append(f"note: {note}")
    if report.timeline:
        out.append(f"wrote {report.timeline} (simulated above, measured step {report.timeline_step} below)")
    return out
