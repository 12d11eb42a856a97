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
                    # (before: the rows it modelled; 62 layers could not fill 64 chunks of at least one layer)
                    mape([(b, r["measured"]) for b, r in pairs if b is not None]),
                    mape([(r["predicted"], r["measured"]) for _, r in pairs]),
                    "<= 7% (issue 26)"))
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

    def h100_sections(self) -> list[str]:
        """The TorchTitan table and the credibility section of docs/validation.md."""
        mfu = self.best_measured_mfu()
        return ["", "### TorchTitan on H100 (Llama 3.1; tokens/s per GPU and peak memory)", "",
                  "`bench/reference_rows.py` turns each row into a plan on `H100-96GB` (the 96 GB, 500 W part: peaks "
                  "halfway between H100 SXM and NVL, ~550 TFLOP/s sustained BF16 GEMMs at the power cap) with the "
                  "`torchtitan` stack, switched per row to eager or compiled, async TP or not, Float8 or not. The "
                  "terms that make it match: SDPA's FlashAttention-2 on Hopper (~0.75 of FA3/cuDNN), eager element-wise "
                  "traffic without torch.compile, op-level selective recompute (matmul and attention outputs kept, "
                  "every other matmul's), FP8 GEMMs with their casts and FP8 all-gather, the loss's fp32 copies of the "
                  "logits (upcast and log-softmax, one more under TP: loss parallel's log-softmax), FSDP2 keeping unsharded "
                  "weights (in FP8 when gathered in FP8) and fp32-accumulated unsharded gradients between micro-batches "
                  "under pp, its shards being the fp32 master weights (4 + 8 bytes per sharded parameter), one layer's "
                  "gathered weights, context parallel as torch's experimental ring attention ran it (K/V repeated to "
                  "every query head before SDPA, all-gathered forward, gathered again in backward, the fp32 dK/dV passed "
                  "around the ring one hop per step), torch.distributed.pipelining keeping every micro-batch's logits (in fp32: TorchTitan's Llama upcasts its output, "
                  "`self.output(h).float()`) and a receive buffer per micro-batch, and the caching allocator's reserve (25% of the "
                  "activations and working memory that churn). Memory is compared without the CUDA context, which "
                  "the allocator's reading does not include.", "", *self.titan_table(), "",
                  "With pp, a rank's local batch is split into pp micro-batches (TorchTitan 9dec370, the benchmark's "
                  "version, runs `pipeline_parallel_microbatches or pp` and its 405B config sets no count): Table 5 is 8 "
                  "micro-batches of 4 sequences, not 32 of one. Not met (tokens/s): the 8B rows at cp 4 and 8 (+26%, "
                  "+32%) and the 405B row at cp 8 (+23%). At fixed tokens per GPU every cost of torch's ring attention "
                  "grows linearly with cp (one SDPA call, one fp32 merge, one dK/dV hop per ring step); the measured 8B "
                  "step grows 4.5 s per extra 32K of keys from cp 1 to 2 but 8.8 s from 2 to 4 and 7.3 s from 4 to 8 "
                  "(predicted: 5.2 s each). Inside one node the K/V exchange hides under attention (0.2-0.7% of the 8B "
                  "steps); the eager fp32 merges and accumulations, if torch.compile left them out, would add at most "
                  "~2 s (their fp32 traffic, by hand) of the 14.5 s gap at 256K. What makes cp >= 4 dearer per key "
                  "is not identified. Across nodes "
                  "(405B, one cp rank per node under tp 8) the heads-wide K/V and fp32 dK/dV hops cost 2-4% of the step "
                  "and bring cp 2 and 4 to +10%, +11%; cp 8 keeps a 47 s gap. Memory: every row within 15%; the 405B "
                  "1F1B row holds 10 GiB more than its interleaved row, while with 8 micro-batches each rank of "
                  "torch's interleaved order holds at least the 1F1B rank's activations (rank 0: 15 layer inputs of 8 "
                  "micro-batches either way; the last rank 8 more chunks): the prediction sits between them, -13% and "
                  "+13%.", "",
                  "### Credibility: error bands, coverage, the planner's ceiling", "",
                  "Each estimate carries the 90th percentile of the absolute throughput residuals of its stack on "
                  "its device class (`error_band` in the JSON, the `error` column of `plan`, and `expected error` in "
                  "`estimate`); stacks and device classes without measured rows say `unknown`. When a plan goes "
                  "where no measured row of its device class is (a larger degree, scale or model, another sequence "
                  "length, schedule, ZeRO level, dtype or recompute, a stack without rows there), `estimate` and "
                  "`plan` print one line, e.g. `extrapolating: no measured row with cp > 1 on A100`. Both tables live "
                  "in `cost/credibility.py`; this script derives them from the CSVs and "
                  "`tests/test_credibility.py` checks the two agree.", "",
                  "| stack | device class | rows | error band |", "|---|---|---|---|",
                  *[f"| {stack} | {cls} | {count} | +-{band:.0%} |" for (stack, cls), (band, count) in
                    sorted(self.band_rows().items())], "",
                  "| device class | stacks with rows | GPUs up to | tp / pp / cp up to | seq_len | schedules | ZeRO | "
                  "dtypes | recompute | params (B) |", "|---|---|---|---|---|---|---|---|---|---|",
                  *[f"| {cls} | {', '.join(c['stacks'])} | {c['max_gpus']} | {c['max_tp']} / {c['max_pp']} / "
                    f"{c['max_cp']} | {c['seq_len'][0]}-{c['seq_len'][1]} | {', '.join(c['schedules'])} | "
                    f"{', '.join(map(str, c['zero_levels']))} | {', '.join(c['dtypes'])} | {', '.join(c['recompute'])}"
                    f" | {c['params_billions'][0]}-{c['params_billions'][1]} |" for cls, c in self.coverage.items()],
                  "", f"Best measured MFU per device class: A100 {mfu['A100']:.1%} (Zero Bubble's 28.3B), H100 "
                  f"{mfu['H100']:.1%} (TorchTitan's Float8 8B against the 500 W part's BF16 peak). "
                  "`tests/test_credibility.py` searches every calibrated stack on the reference tables' models and "
                  "clusters and requires its best plan at or below that plus 5 points; issue 17's GPT-3 175B (batch 1536, "
                  "default bf16) with `megatron-lm-2022` is among them: 61.1% on 256 A100 and 56.0% on 1536 (in fp16, "
                  "whose gradients travel in 2 bytes, 61.5% on 256: 0.3 points above the ceiling, not in the test)."]

    # --- credibility ----------------------------------------------------------------------------
    def band_rows(self) -> dict[tuple[str, str], tuple[float, int]]:
        counts = {("megatron-lm-2022", "A100"): sum(len(res["rows_list"]) for _, res in self.vtrain)
                  + sum(1 for r in self.bubble if r.get("predicted")),
                  ("megatron-core", "H100"): len(self.core), ("torchtitan", "H100"): len(self.titan),
                  ("fivefold", "H100"): sum(1 for r in self.titan if r.get("predicted_fivefold") is not None)}
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
            modelled = [(b, m) for b, m in zip(before, measured) if b is not None]
            axis.scatter([m for _, m in modelled], [100 * (b / m - 1) for b, m in modelled], s=10, color="0.6",
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
