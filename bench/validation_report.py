"""docs/validation.md's issue-17 sections: before and after per source and stack, TorchTitan on H100, the
credibility tables (error bands, coverage), residual plots. Used by bench/validate_cost_model.py."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from reference_rows import credibility_tables

from fivefold.cost.credibility import COVERAGE, ERROR_BANDS

BEFORE = Path(__file__).resolve().parent / "validation_before.json"


def mape(pairs: list[tuple[float, float]]) -> float:
    """Mean absolute relative error of (predicted, measured) pairs."""
    return statistics.fmean(abs(p / m - 1) for p, m in pairs)


class Report:
    def __init__(self, reference: Path, vtrain: list, core: list[dict], bubble: list[dict], titan: list[dict],
                 kort: list[dict], vtrain_plans: list) -> None:
        self.vtrain, self.core, self.bubble, self.titan, self.kort = vtrain, core, bubble, titan, kort
        self.before = json.loads(BEFORE.read_text())
        plans = {"vtrain": vtrain_plans, "bubble": [r["plan"] for r in bubble if r.get("plan")],
                 "core": [r["plan"] for r in core], "titan": [r["plan"] for r in titan]}
        self.coverage, self.bands = credibility_tables([r for _, res in vtrain for r in res["rows_list"]],
                                                       bubble, core, titan, plans)

    # --- before / after -------------------------------------------------------------------------
    def summary_rows(self) -> list[tuple[str, str, str, str, int, float, float, str]]:
        """(source, stack, device, metric, rows, MAPE before, MAPE after, target) per source."""
        out = []
        for name, result in self.vtrain:
            rows = result["rows_list"]
            before = mape([(b, r["measured_s"]) for b, r in zip(self.before[name], rows)])
            target = "<= 7%" if "multi" in name else "not worse"
            out.append((name, "megatron-lm-2022", "A100", "step time", len(rows), before, result["mape"], target))
        core_before = mape([(b, r["measured_tflops"]) for b, r in zip(self.before["megatron_core_h100.csv"], self.core)])
        out.append(("megatron_core_h100.csv", "megatron-core", "H100", "TFLOP/s", len(self.core), core_before,
                    mape([(r["predicted_tflops"], r["measured_tflops"]) for r in self.core]), "each within 10%"))
        pairs = [(b, r) for b, r in zip(self.before["zero_bubble_a100.csv"], self.bubble) if r.get("predicted")]
        out.append(("zero_bubble_a100.csv", "megatron-lm-2022", "A100", "samples/s", len(pairs),
                    mape([(b, r["measured"]) for b, r in pairs]), mape([(r["predicted"], r["measured"]) for _, r in pairs]),
                    "not worse"))
        titan_before = self.before["torchtitan_h100.csv"]
        out.append(("torchtitan_h100.csv", "torchtitan (before: modern)", "H100", "tokens/s/GPU", len(self.titan),
                    mape([(b["tokens_per_s_per_gpu"], r["measured"]) for b, r in zip(titan_before, self.titan)]),
                    mape([(r["predicted"], r["measured"]) for r in self.titan]), "each within 15%"))
        out.append(("torchtitan_h100.csv", "torchtitan (before: modern)", "H100", "peak memory", len(self.titan),
                    mape([(b["memory_gib"], r["measured_memory"]) for b, r in zip(titan_before, self.titan)]),
                    mape([(r["predicted_memory"], r["measured_memory"]) for r in self.titan]), "each within 15%"))
        return out

    def titan_table(self) -> list[str]:
        lines = ["| model | layout | compile | float8 | async TP | tokens/s/GPU measured | before | after | "
                 "memory GiB measured | before | after |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for before, row in zip(self.before["torchtitan_h100.csv"], self.titan):
            lines.append(
                f"| {row['model']} | {row['layout']} | {row['compile']} | {row['float8']} | {row['async_tp']} | "
                f"{row['measured']:.0f} | {before['tokens_per_s_per_gpu']:.0f} "
                f"({before['tokens_per_s_per_gpu'] / row['measured'] - 1:+.0%}) | {row['predicted']:.0f} "
                f"({row['predicted'] / row['measured'] - 1:+.0%}) | {row['measured_memory']:.1f} | "
                f"{before['memory_gib']:.1f} ({before['memory_gib'] / row['measured_memory'] - 1:+.0%}) | "
                f"{row['predicted_memory']:.1f} ({row['predicted_memory'] / row['measured_memory'] - 1:+.0%}) |")
        return lines

    # --- credibility ----------------------------------------------------------------------------
    def band_rows(self) -> dict[tuple[str, str], tuple[float, int]]:
        counts = {("megatron-lm-2022", "A100"): sum(len(res["rows_list"]) for _, res in self.vtrain)
                  + sum(1 for r in self.bubble if r.get("predicted")),
                  ("megatron-core", "H100"): len(self.core), ("torchtitan", "H100"): len(self.titan)}
        return {key: (band, counts[key]) for key, band in self.bands.items()}

    def credibility_text(self) -> str:
        lines = ["error bands (90th percentile of |throughput residual|) and coverage from the development set:"]
        for key, band in sorted(self.bands.items()):
            held = ERROR_BANDS.get(key)
            lines.append(f"  {key}: +-{band:.0%}" + ("" if held == band else f"  (cost/credibility.py has {held})"))
        for cls, cover in self.coverage.items():
            held = COVERAGE.get(cls)
            same = held is not None and all(getattr(held, k) == v for k, v in cover.items())
            lines.append(f"  {cls}: {cover}" + ("" if same else "  (differs from cost/credibility.py)"))
        return "\n".join(lines)

    def best_measured_mfu(self) -> dict[str, float]:
        """Highest measured MFU per device class (model FLOPs against the BF16/FP16 peak)."""
        a100 = [r["measured_mfu"] for r in self.bubble if r.get("measured_mfu")]
        a100 += [r["measured_mfu"] for _, res in self.vtrain for r in res["rows_list"] if "measured_mfu" in r]
        h100 = [r["measured_mfu"] for r in self.core] + [r["measured_mfu"] for r in self.titan]
        return {"A100": max(a100) if a100 else 0.0, "H100": max(h100)}

    # --- pictures -------------------------------------------------------------------------------
    def write_plots(self, folder: Path) -> list[str]:
        """Residual plots (predicted / measured - 1, before and after) per source, as PNG; file names."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        folder.mkdir(parents=True, exist_ok=True)
        series = []
        for name, result in self.vtrain:
            rows = result["rows_list"]
            series.append((name, "step time", [r["measured_s"] for r in rows], self.before[name],
                           [r["predicted_s"] for r in rows]))
        series.append(("megatron_core_h100.csv", "TFLOP/s per GPU", [r["measured_tflops"] for r in self.core],
                       self.before["megatron_core_h100.csv"], [r["predicted_tflops"] for r in self.core]))
        kept = [(b, r) for b, r in zip(self.before["zero_bubble_a100.csv"], self.bubble) if r.get("predicted")]
        series.append(("zero_bubble_a100.csv", "samples/s per GPU", [r["measured"] for _, r in kept],
                       [b for b, _ in kept], [r["predicted"] for _, r in kept]))
        titan_before = self.before["torchtitan_h100.csv"]
        series.append(("torchtitan_h100.csv", "tokens/s per GPU", [r["measured"] for r in self.titan],
                       [b["tokens_per_s_per_gpu"] for b in titan_before], [r["predicted"] for r in self.titan]))
        series.append(("torchtitan_h100.csv", "peak memory (GiB)", [r["measured_memory"] for r in self.titan],
                       [b["memory_gib"] for b in titan_before], [r["predicted_memory"] for r in self.titan]))
        names = []
        for source, metric, measured, before, after in series:
            fig, axis = plt.subplots(figsize=(7, 3.6))
            axis.scatter(measured, [100 * (b / m - 1) for b, m in zip(before, measured)], s=10, color="0.6",
                         label="before (main at 3302110)")
            axis.scatter(measured, [100 * (a / m - 1) for a, m in zip(after, measured)], s=12, color="tab:blue",
                         label="after")
            axis.axhline(0, color="black", linewidth=0.8)
            axis.set_xscale("log")
            axis.set_xlabel(f"measured {metric}")
            axis.set_ylabel("predicted / measured - 1 (%)")
            axis.set_title(f"{source}: {metric}", fontsize=10)
            axis.grid(alpha=0.3)
            axis.legend(fontsize=8)
            fig.tight_layout()
            file = f"residuals-{source.removesuffix('.csv').replace('_', '-')}-{metric.split()[0].replace('/', '')}.png"
            fig.savefig(folder / file, dpi=90)
            plt.close(fig)
            names.append(file)
        return names
