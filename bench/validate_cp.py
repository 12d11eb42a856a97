"""Context parallel in the cost model vs TorchTitan's long-context tables (Llama 3.1 8B on 8 H100, Table 2;
405B on 512 H100, Table 6): sequence 32K -> 262K while cp grows 1 -> 8 and the FSDP degree shrinks so the
tokens per step stay the same. Prints predicted and measured tokens/s per GPU and memory, and the trend
(each row relative to the cp1 row of its table), as markdown for docs/validation.md.

    .venv/bin/python bench/validate_cp.py
"""

from __future__ import annotations

import csv
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from fivefold.cost import estimate  # noqa: E402
from fivefold.cost.stack import stack_named  # noqa: E402
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster  # noqa: E402

REFERENCE = Path(__file__).resolve().parent.parent.parent / "shared" / "reference" / "torchtitan_h100.csv"
MODELS = {"llama3.1-8b": "llama3-8b", "llama3.1-405b": "llama3-405b"}
GIB = 2**30


def rows(tables: tuple[str, ...] = ("2", "6")) -> list[dict]:
    path = REFERENCE if REFERENCE.is_file() else Path("/work/shared/reference/torchtitan_h100.csv")
    with open(path) as handle:
        return [r for r in csv.DictReader(handle) if r["table"] in tables]


def plan_of(row: dict, cp_method: str = "allgather") -> Plan:
    """The TorchTitan run as a fivefold plan: FSDP (ZeRO-3) over the fsdp degree, full recompute, FP8."""
    gpus, tp, pp, cp = (int(row[k]) for k in ("gpus", "tp", "pp", "cp"))
    seq = int(row["seq_len"])
    model = replace(PRESETS[MODELS[row["model"]]], max_seq_len=max(seq, 131072))
    nodes = max(1, gpus // 8)
    cluster = parse_cluster(f"{nodes}x{min(gpus, 8)}xH100-96GB:nic={int(min(gpus, 8) * 400)}Gb/s")
    train = TrainSpec(seq_len=seq, global_batch=int(row["global_batch"]),
                      dtype="fp8" if row["float8"] == "yes" else "bf16")
    micro_batch = int(row["local_batch"]) // pp  # pp micro-batches (bench/reference_rows.py)
    return Plan(model=model, cluster=cluster, train=train, dp=int(row["fsdp"]), tp=tp, pp=pp, cp=cp,
                cp_method=cp_method, zero=3, micro_batch=micro_batch, schedule=row["schedule"] or "1f1b",
                recompute=row["activation_checkpoint"], sequence_parallel=tp > 1)


def main() -> int:
    stack = stack_named("torchtitan")
    lines = ["| table | model | cp | seq | measured tok/s/GPU | predicted | ratio | trend measured | trend predicted "
             "| cp share of step | memory measured / predicted GiB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    base: dict[str, tuple[float, float]] = {}
    for row in rows():
        plan = plan_of(row)
        est = estimate(plan, stack)
        measured = float(row["tokens_per_s_per_gpu"])
        predicted = est.tokens_per_s / plan.world_size
        first = base.setdefault(row["table"], (measured, predicted))
        cp_share = est.breakdown_s.get("cp_comm", 0.0) / est.step_time_s
        lines.append(f"| {row['table']} | {row['model']} | {plan.cp} | {plan.train.seq_len // 1024}K | {measured:,.0f} "
                     f"| {predicted:,.0f} | {predicted / measured:.2f} | {measured / first[0]:.2f} "
                     f"| {predicted / first[1]:.2f} | {cp_share:.1%} | {row['memory_gib']} / "
                     f"{est.memory.total / GIB:.1f} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
