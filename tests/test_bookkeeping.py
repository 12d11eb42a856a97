"""Per-step bookkeeping: one small collective per step besides the gradient sync (loss, gradient-norm terms
and rank 0's metrics request together), the per-rank metrics gather only every --metrics-every steps and on
the first, last, bad and straggler-suspect steps (runtime/bookkeeping.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fivefold.runtime.bookkeeping import gathers_metrics

# The torch.distributed calls the loop's bookkeeping could make. The gradient sync is left out: DDP's
# buckets are all-reduced by the runtime's comm hook with async_op=True (runtime/parallelize.py).
COUNTED = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
           "broadcast_object_list", "barrier", "reduce", "gather", "scatter")
STEPS, EVERY = 7, 3


def test_metrics_gathered_every_n_steps_and_when_needed():
    steps = [s for s in range(1, 21) if gathers_metrics(s, 1, 20, 10, bad_step=False, requested=False)]
    assert steps == [1, 10, 20]
    assert gathers_metrics(7, 1, 20, 10, bad_step=True, requested=False)
    assert gathers_metrics(7, 1, 20, 10, bad_step=False, requested=True)
    assert gathers_metrics(5, 5, 20, 10, bad_step=False, requested=False)  # first step after a resume


def _count_collectives(rank: int, world: int, port: int, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch.distributed as dist

    from fivefold.runtime import RunConfig
    from fivefold.runtime.knobs import FaultKnobs
    from fivefold.runtime.train import train
    from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

    step = [0]
    counts: dict[int, int] = {}

    class StepMarks(FaultKnobs):
        def step_started(self, number: int, rank: int, restart: int) -> None:
            step[0] = number

    def counting(function):
        def wrapper(*args, **kwargs):
            if not kwargs.get("async_op"):
                counts[step[0]] = counts.get(step[0], 0) + 1
            return function(*args, **kwargs)
        return wrapper

    for name in COUNTED:
        setattr(dist, name, counting(getattr(dist, name)))
    plan = Plan(model=PRESETS["tiny"], cluster=parse_cluster(f"1x{world}xcpu"), dp=world, micro_batch=2,
                train=TrainSpec(seq_len=32, global_batch=4, dtype="fp32"))
    train(RunConfig(plan.to_toml(), steps=STEPS, device="cpu", show_progress=False, metrics_every=EVERY,
                    straggler_factor=0, metrics_file=str(Path(folder) / "metrics.jsonl")), StepMarks())
    (Path(folder) / f"counts-{rank}.json").write_text(json.dumps(counts))
    dist.destroy_process_group()


@pytest.mark.slow
def test_one_bookkeeping_collective_per_step(tmp_path):
    import torch.multiprocessing as mp

    from fivefold.runtime.launch import free_port

    mp.spawn(_count_collectives, args=(2, free_port(), str(tmp_path)), nprocs=2)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    gathered = [r["step"] for r in records if "step_time_s_per_rank" in r]
    assert gathered == [1, 3, 6, 7]
    for rank in (0, 1):
        counts = {int(k): v for k, v in json.loads((tmp_path / f"counts-{rank}.json").read_text()).items()}
        per_step = [counts.get(step, 0) for step in range(1, STEPS + 1)]
        assert per_step == [2 if step in gathered else 1 for step in range(1, STEPS + 1)], per_step
