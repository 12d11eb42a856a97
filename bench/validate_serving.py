"""Serving cost model vs the development set (shared/reference serving_*.csv, see its SERVING.md).

Rows predicted (every BF16/FP16/FP8 row of plain decoding or in-flight batching on an NVIDIA GPU the catalog has):
- gpt-fast (A100-80GB, tp 1-8, batch 1, prompt 5, 200 new tokens): decode tokens/s per user = 200 / (prefill +
  200 x TPOT) of `estimate --serve` with --batch 1.
- TensorRT-LLM in-flight batching, offline (v0.13, 0.17, 0.19, 0.20, 1.0): output tokens/s of the whole tp group
  with --rate inf and the row's ISL/OSL/num_requests (max batch 4096 and 8192 tokens per step, the build
  heuristics' printout in the doc; KV memory 0.95 of what is free, the doc's setting).
- TensorRT-LLM online serving (v0.14 via Triton, fixed QPS): mean TTFT, mean inter-token latency and output
  tokens/s at each QPS (mean values, so the estimate's mean fields).
Set aside, as the issue allows: weight-only int8/int4 rows (no int8/int4 GEMM model), TensorRT-LLM v0.9.0
(static batching), the speculative-decoding row, the MI250X rows (not NVIDIA), GH200 rows (no Grace-Hopper
device in the catalog). The `memory_bandwidth_gb_s` rows of gpt-fast restate tokens/s (bytes x tokens/s) and are
not counted twice.

Usage: python bench/validate_serving.py [--reference DIR] [--worst N]
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from fivefold.cost.deployment import place
from fivefold.cost.serving_estimate import estimate_serving
from fivefold.spec import PRESETS, ModelSpec, parse_cluster
from fivefold.spec.serve import BatchLimits, ServeLayout
from fivefold.spec.units import GIB
from fivefold.spec.workload import Length, Workload

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REFERENCE = next((p for p in (ROOT.parent / "shared" / "reference", ROOT / "shared" / "reference",
                                      Path("/work/shared/reference")) if p.is_dir()),
                         ROOT.parent / "shared" / "reference")
TARGET_MAPE = 10.0

# Shapes from the models' published config.json files (Hugging Face); Llama 3 / 3.1 / Mixtral are presets.
LLAMA2_7B = ModelSpec(name="llama2-7b", layers=32, hidden=4096, heads=32, ffn_hidden=11008, vocab=32000)
MODELS = {
    "Llama-2-7B": LLAMA2_7B, "LLaMA-7B": LLAMA2_7B,
    "Llama-2-70B": ModelSpec(name="llama2-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672,
                             vocab=32000),
    "Llama-3-8B": PRESETS["llama3-8b"], "Llama-3.1-8B": PRESETS["llama3-8b"],
    "Llama-3.1-70B": PRESETS["llama3-70b"], "Mixtral-8x7B": PRESETS["mixtral-8x7b"],
    "Mistral-7B": ModelSpec(name="mistral-7b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336,
                            vocab=32000),
    "GPT-J-6B": ModelSpec(name="gpt-j-6b", layers=28, hidden=4096, heads=16, ffn_hidden=16384, vocab=50400,
                          mlp="gelu", norm="layernorm"),
}
GPUS = {"H100-SXM-80GB": "H100-SXM", "H200-SXM-141GB": "H200", "A100-SXM4-80GB": "A100-80GB",
        "L40S": "L40S"}
TRT_LIMITS = BatchLimits(max_batch=4096, max_tokens_per_step=8192)
# The Triton rows' engine limits are not printed; tensorrtllm_backend's inflight_batcher_llm templates are
# filled with the user's triton_max_batch_size, and 256 is what matches the rows' inter-token latency at qps=inf.
TRITON_LIMITS = BatchLimits(max_batch=256, max_tokens_per_step=8192)
TRT_KV_SHARE = 0.95  # and its default GUARANTEED_NO_EVICT admission: no_evict=True
# Triton's ensemble (HTTP, the Python tokenizer model, the first detokenization) before the first token: the
# rows' TTFT at 2 QPS less the predicted prefill, ~10 ms.
TRITON_FRONTEND_S = 0.010
# ... and its Python postprocessing of every streamed token, per request per step (fitted on the rows' ITL).
TRITON_PER_REQUEST_S = 0.0  # kv_cache_free_gpu_mem_fraction


@dataclass
class Row:
    source: str  # gpt-fast | trtllm-offline | trtllm-online
    label: str
    metric: str
    measured: float
    predicted: float

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.predicted - self.measured) / self.measured


def _predict(model: ModelSpec, device: str, tp: int, pp: int, dtype: str, limits: BatchLimits,
             workload: Workload, kv_share: float | None, frontend_s: float = 0.0):
    cluster = parse_cluster(f"1x{max(8, tp * pp)}x{device}" if device not in ("L40S",) else f"1x{max(4, tp * pp)}x{device}")
    layout = ServeLayout(tp=tp, pp=pp, dtype=dtype, kv_dtype=dtype, limits=limits)
    kv_memory = None
    if kv_share is not None:
        probe = place(model, cluster, layout, kv_blocks=1)[0]
        free = probe.cost.device_spec.memory_bytes - probe.cost.weight_bytes - 2 * GIB
        kv_memory = max(free * kv_share, 0.1 * GIB) / GIB
    replicas = place(model, cluster, layout, kv_memory_gib=kv_memory)
    for replica in replicas:
        replica.cost.host_per_request_s = TRITON_PER_REQUEST_S if frontend_s else 0.0
    return estimate_serving(replicas, limits, workload, pp, frontend_s, no_evict=kv_share is not None)


def gptfast_rows(reference: Path) -> list[Row]:
    rows = []
    with open(reference / "serving_gptfast.csv") as f:
        for row in csv.DictReader(f):
            if (row["metric"] != "decode_tokens_per_s_per_user" or row["precision"] != "bf16"
                    or not row["gpu"].startswith("A100") or not row["input_len"]):
                continue
            tp, out = int(row["tp"]), int(row["output_len"])
            workload = Workload(prompt_len=Length(float(row["input_len"])), output_len=Length(out), batch=1)
            est = _predict(MODELS[row["model"]], "A100-80GB", tp, 1, "bf16", BatchLimits(), workload, None)
            per_user = out / (est.ttft_s + (out - 1) * est.tpot_s)
            rows.append(Row("gpt-fast", f"{row['model']} tp{tp}", "decode tok/s/user", float(row["value"]), per_user))
    return rows


def trtllm_rows(reference: Path) -> list[Row]:
    rows = []
    with open(reference / "serving_trtllm_dev.csv") as f:
        for row in csv.DictReader(f):
            version, gpu = row["trtllm_version"], GPUS.get(row["gpu"])
            if version == "0.9.0" or gpu is None or row["precision"] not in ("FP8", "FP16", "BF16"):
                continue
            dtype = "fp8" if row["precision"] == "FP8" else "bf16"
            tp, pp = int(row["tp"] or 1), int(row["pp"] or 1)
            isl, osl, n = int(row["input_len"]), int(row["output_len"]), int(float(row["num_requests"] or 1000))
            online = version == "0.14.0"
            if online and row["metric"] not in ("ttft_ms_mean", "itl_ms_mean", "output_tokens_per_s_total"):
                continue
            rate = float(row["qps"]) if online else math.inf
            workload = Workload(prompt_len=Length(isl), output_len=Length(osl), rate=rate, num_requests=n)
            try:
                est = _predict(MODELS[row["model"]], gpu, tp, pp, dtype, TRITON_LIMITS if online else TRT_LIMITS,
                               workload, TRT_KV_SHARE, TRITON_FRONTEND_S if online else 0.0)
            except Exception as exc:  # a row the model cannot place (too big): say so, do not hide it
                print(f"skipped {row['model']} {gpu} tp{tp}: {exc}")
                continue
            # A benchmark of n requests at a finite rate divides their output by the time from the first arrival
            # to the last answer: n / rate plus the last request's own latency (TTFT + the rest of its tokens).
            throughput = est.output_tokens_per_s
            if online and math.isfinite(rate):
                throughput = n * osl / (n / rate + est.ttft_s + (osl - 1) * est.tpot_s)
            predicted = {"ttft_ms_mean": est.ttft_s * 1e3, "itl_ms_mean": est.tpot_s * 1e3,
                         "output_tokens_per_s_total": throughput}[row["metric"]]
            label = f"{row['model']} {gpu} tp{tp} {row['precision']} {isl}/{osl} v{version}" + (
                f" qps={row['qps']}" if online else "")
            rows.append(Row("trtllm-online" if online else "trtllm-offline", label, row["metric"],
                            float(row["value"]), predicted))
    return rows


def all_rows(reference: Path = DEFAULT_REFERENCE) -> list[Row]:
    return gptfast_rows(reference) + trtllm_rows(reference)


def mape(rows: list[Row]) -> float:
    return statistics.fmean(abs(r.error_pct) for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, default=DEFAULT_REFERENCE)
    parser.add_argument("--worst", type=int, default=10)
    args = parser.parse_args()
    rows = all_rows(args.reference)
    print(f"{'source':16} {'rows':>5} {'MAPE %':>7} {'bias %':>7}")
    for source in ("gpt-fast", "trtllm-offline", "trtllm-online"):
        mine = [r for r in rows if r.source == source]
        if mine:
            print(f"{source:16} {len(mine):5d} {mape(mine):7.1f} {statistics.fmean(r.error_pct for r in mine):7.1f}")
    print(f"{'all':16} {len(rows):5d} {mape(rows):7.1f}   (target <= {TARGET_MAPE:.0f})")
    print(f"\nworst {args.worst}:")
    for r in sorted(rows, key=lambda r: -abs(r.error_pct))[:args.worst]:
        print(f"  {r.error_pct:+7.1f}%  {r.label} {r.metric}: measured {r.measured:g}, predicted {r.predicted:.4g}")


if __name__ == "__main__":
    main()
