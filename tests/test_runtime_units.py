"""Runtime pieces that need no process group: schedules of the learning rate, rows of each replica,
stage models, the global gradient norm, activation recompute, FLOP counts, pre-launch checks."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fivefold.errors import SpecError
from fivefold.models import init_weights
from fivefold.runtime import RunConfig, check_runnable, torchrun_command
from fivefold.runtime.metrics import METRIC_FIELDS, MetricsFile, Progress, peak_flops
from fivefold.runtime.optim import _replicas, build_optimizer, clip_grad_norm_, lr_at
from fivefold.runtime.parallelize import apply_activation_checkpointing
from fivefold.runtime.pipeline import build_stage_model, stage_layers
from fivefold.runtime.train import TokenCrossEntropy, replica_rows
from fivefold.spec import PRESETS, ModelSpec, Plan, TrainSpec, parse_cluster


def make_plan(world: int = 1, model: ModelSpec | str = "tiny", seq_len: int = 32, **fields) -> Plan:
    spec = PRESETS[model] if isinstance(model, str) else model
    return Plan(model=spec, cluster=parse_cluster(f"1x{world}xcpu"),
                train=TrainSpec(seq_len=seq_len, global_batch=8, dtype="fp32"), **fields)


# --- learning rate -------------------------------------------------------------------------------

def test_lr_warmup_then_cosine_to_a_tenth():
    peak = 1e-3
    assert lr_at(0, peak, warmup_steps=2, total_steps=11) == pytest.approx(0.5e-3)
    assert lr_at(1, peak, 2, 11) == pytest.approx(1e-3)
    assert lr_at(2, peak, 2, 11) == pytest.approx(1e-3)  # cosine starts at the peak
    assert lr_at(6, peak, 2, 11) == pytest.approx(0.55e-3)  # half way: (1 + 0.1) / 2
    assert lr_at(10, peak, 2, 11) == pytest.approx(0.1e-3)  # last step: 10% of peak
    assert lr_at(0, peak, 0, 1) == pytest.approx(0.1e-3)  # no warmup, one step: it is the last, at min_lr


# --- data split and loss -----------------------------------------------------------------------

def test_replica_rows_even_and_uneven():
    even = make_plan(2, dp=2, micro_batch=2)
    assert [replica_rows(even, r) for r in range(2)] == [slice(0, 4), slice(4, 8)]
    uneven = make_plan(2, dp=2, micro_batch=1, replica_micro_batches=(3, 5))
    assert [replica_rows(uneven, r) for r in range(2)] == [slice(0, 3), slice(3, 8)]


def test_token_cross_entropy_sums_to_the_global_mean():
    torch.manual_seed(0)
    logits, targets = torch.randn(4, 5, 11), torch.randint(0, 11, (4, 5))
    loss_fn = TokenCrossEntropy(global_tokens=20)
    halves = loss_fn(logits[:2], targets[:2]) + loss_fn(logits[2:], targets[2:])
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert halves.item() == pytest.approx(expected.item(), rel=1e-6)


# --- pipeline stages -----------------------------------------------------------------------------

def test_uneven_stage_models_keep_their_names():
    plan = make_plan(2, pp=2, layers_per_stage=(1, 3))
    assert list(stage_layers(plan, 0)) == [0] and list(stage_layers(plan, 1)) == [1, 2, 3]
    first, last = build_stage_model(plan, 0), build_stage_model(plan, 1)
    assert list(first.layers) == ["0"] and first.tok_embeddings is not None and first.output is None
    assert list(last.layers) == ["1", "2", "3"] and last.tok_embeddings is None and last.norm is not None
    names = {n for n, _ in first.named_parameters()} | {n for n, _ in last.named_parameters()}
    whole = {n for n, _ in build_stage_model(make_plan(), 0).named_parameters()}
    assert names == whole


def test_interleaved_and_v_stage_owners():
    looped = make_plan(2, pp=2, schedule="interleaved-1f1b", virtual_stages=2)
    assert looped.stages_of(0) == [0, 2] and list(stage_layers(looped, 2)) == [2]
    v_shape = make_plan(2, pp=2, schedule="zbv", virtual_stages=2)
    assert v_shape.stages_of(0) == [0, 3] and v_shape.stages_of(1) == [1, 2]


def test_stage_forward_matches_whole_model():
    """Chaining the stage models on real weights gives the whole model's logits exactly."""
    plan = make_plan(2, pp=2, layers_per_stage=(3, 1))
    whole = build_stage_model(make_plan(), 0).to_empty(device="cpu")
    init_weights(whole, seed=3)
    stages = [build_stage_model(plan, s).to_empty(device="cpu") for s in range(2)]
    for stage in stages:
        init_weights(stage, seed=3)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(stages[1](stages[0](tokens)), whole(tokens), rtol=0, atol=0)


# --- gradient norm and optimizer -----------------------------------------------------------------

def test_replicas_count_every_dim_but_pp():
    plan = make_plan(8, dp=2, tp=2, pp=2)
    assert _replicas(plan, set()) == 4
    assert _replicas(plan, {"tp"}) == 2
    assert _replicas(plan, {"dp", "tp"}) == 1


def test_clip_grad_norm_single_process():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1, 1))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])
    norm = clip_grad_norm_([a, b], max_norm=1.0, plan=make_plan())
    assert norm == pytest.approx(5.0)
    assert a.grad.tolist() == pytest.approx([0.6, 0.0], rel=1e-5) and b.grad.item() == pytest.approx(0.8, rel=1e-5)
    assert clip_grad_norm_([a, b], max_norm=10.0, plan=make_plan()) == pytest.approx(1.0, rel=1e-5)
    assert b.grad.item() == pytest.approx(0.8, rel=1e-5)  # under the limit: unchanged


def test_weight_decay_only_on_matrices():
    model = build_stage_model(make_plan(), 0)
    optimizer = build_optimizer(list(model.parameters()), lr=1e-3)
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert optimizer.defaults["betas"] == (0.9, 0.95)


# --- activation recompute ------------------------------------------------------------------------

class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _backward_op_counts(recompute: str) -> dict[str, int]:
    model = build_stage_model(make_plan(recompute=recompute), 0)
    apply_activation_checkpointing(model, recompute)
    model.to_empty(device="cpu")
    init_weights(model, seed=0)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(tokens).sum()
    with CountOps() as counter:
        loss.backward()
    return counter.counts


def test_recompute_full_reruns_blocks_and_selective_keeps_matmuls():
    none, full, selective = (_backward_op_counts(mode) for mode in ("none", "full", "selective"))
    assert none.get("silu", 0) == 0  # nothing is recomputed without checkpointing
    # Full: every block's forward runs again in backward, up to the last tensor backward needs (torch
    # stops early): q,k,v,o,w1,w3 of the 7 projections, the output of w2 is never needed. 4 layers.
    assert full["mm"] - none["mm"] == 6 * 4 and full["silu"] == 4
    # Selective: matmul outputs were kept, only the cheap ops (silu, norms) run again.
    assert selective["mm"] == none["mm"] and selective["silu"] == 4


def test_recompute_keeps_seeded_weights():
    plain, wrapped = build_stage_model(make_plan(), 0), build_stage_model(make_plan(), 0)
    apply_activation_checkpointing(wrapped, "full")
    for model in (plain, wrapped):
        model.to_empty(device="cpu")
        init_weights(model, seed=1)
    torch.testing.assert_close(plain.layers["2"].attention.wq.weight,
                               wrapped.layers["2"]._checkpoint_wrapped_module.attention.wq.weight)


# --- FLOPs and metrics ---------------------------------------------------------------------------

def test_peak_flops_sums_the_plan_devices():
    plan = make_plan(4, dp=4)
    assert peak_flops(plan, "fp32") == 4 * 100e9  # the cpu catalog entry
    mixed = Plan(model=PRESETS["tiny"], cluster=parse_cluster("1x2xA100-80GB+1x2xH100-SXM"),
                 train=TrainSpec(seq_len=32, global_batch=8, dtype="bf16"), dp=4)
    assert peak_flops(mixed, "bf16") == pytest.approx(2 * 312e12 + 2 * 989.4e12)


def test_metrics_file_and_plain_progress(tmp_path):
    record = {"step": 1, "loss": 5.5, "grad_norm": 2.0, "lr": 1e-3, "tokens": 256, "step_time_s": 0.5,
              "tokens_per_s": 512.0, "mfu": 0.01, "peak_memory_gib": 0.25}
    assert set(record) == set(METRIC_FIELDS)
    metrics = MetricsFile(str(tmp_path / "run" / "metrics.jsonl"))
    metrics.write(record)
    metrics.write({**record, "step": 2})
    metrics.close()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    stream = io.StringIO()
    progress = Progress(3, "training tiny", stream)
    progress.update(record)
    progress.close()
    assert stream.getvalue().splitlines() == [
        "training tiny",
        "step 1/3  loss 5.5000  grad_norm 2.000  lr 1.00e-03  512 tok/s  mfu 1.00%  mem 0.25 GiB  500.0 ms/step"]


# --- pre-launch checks ---------------------------------------------------------------------------

@pytest.mark.parametrize("plan_fields, nproc, field", [
    (dict(world=2, dp=2), 4, "--nproc"),
    (dict(world=2, tp=2, model=ModelSpec(vocab=255, heads=4, hidden=64)), 2, "plan.tp"),
    (dict(world=2, pp=2, model=ModelSpec(layers=2, tied_embeddings=True)), 2, "model.tied_embeddings"),
    (dict(world=2, tp=2, model=ModelSpec(layers=2, tied_embeddings=True)), 2, "model.tied_embeddings"),
    (dict(world=2, dp=2, pp=1, cp=1, tp=1, zero=0), 2, None),
    (dict(world=4, dp=2, pp=2, zero=3, schedule="zbv", virtual_stages=2), 4, "plan.zero"),
    (dict(world=2, pp=2, schedule="zb-h1", recompute="selective"), 2, "plan.recompute"),
    (dict(world=2, pp=2, micro_batch=8), 2, "plan.micro_batch"),
    (dict(world=2, cp=2), 2, None),  # context parallel runs (runtime/context_parallel.py)
])
def test_check_runnable(plan_fields, nproc, field):
    world = plan_fields.pop("world")
    plan = make_plan(world, **plan_fields)
    if field is None:
        check_runnable(plan, nproc)
        return
    with pytest.raises(SpecError) as error:
        check_runnable(plan, nproc)
    assert error.value.field == field
    assert "\n" not in str(error.value)


def test_placement_across_machines_permutes_devices_within_a_node_only():
    from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

    def plan_on(cluster: str, placement: tuple[int, ...]) -> Plan:
        return Plan(model=PRESETS["tiny"], cluster=parse_cluster(cluster), train=TrainSpec(seq_len=32, global_batch=8),
                    dp=4, placement=placement)

    check_runnable(plan_on("2x2xcpu", (1, 0, 3, 2)), 4, local_nproc=2)
    check_runnable(plan_on("2x2xcpu", (2, 3, 0, 1)), 4)  # one machine runs all four: any device order
    with pytest.raises(SpecError, match="puts rank 0 on device 2 \\(node 1\\) but torchrun starts rank 0 on node 0"):
        check_runnable(plan_on("2x2xcpu", (2, 3, 0, 1)), 4, local_nproc=2)


def test_check_runnable_cuda_needs_gpus():
    with pytest.raises(SpecError, match="2 processes need 2 GPUs on this machine, found 1"):
        check_runnable(make_plan(2, dp=2), 2, device="cuda", gpus=1)
    check_runnable(make_plan(2, dp=2), 2, device="cuda", gpus=1, local_nproc=1)  # one per node on 2 nodes


def test_torchrun_command_repeats_the_run_flags_not_the_layout():
    from fivefold.cli import build_parser

    args = build_parser().parse_args(["train", "--cluster", "2x8xH100", "--tp", "8", "--steps", "100", "--seed", "3",
                                      "--lr", "1e-3", "--metrics-file", "runs/a/metrics.jsonl", "--resume",
                                      "--checkpoint-dir", "ck", "--nproc", "16", "--max-restarts", "2"])
    assert torchrun_command("runs/a/plan.toml", RunConfig.from_flags(vars(args)).to_flags(), nnodes=2, nproc_per_node=8) == (
        "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 "
        "-m fivefold train --torchrun-worker --plan runs/a/plan.toml --steps 100 --seed 3 --lr 0.001 "
        "--metrics-file runs/a/metrics.jsonl --checkpoint-dir ck --resume")
    assert math.isclose(lr_at(99, 1e-3, 2, 100), 1e-4)


def test_run_config_flags_round_trip_through_the_train_parser():
    from fivefold.cli import build_parser

    config = RunConfig(make_plan(1).to_toml(), steps=7, lr=1e-4, grad_clip=0.5,
                       trace=True, metrics_file="runs/b/metrics.jsonl", straggler_factor=0.0, keep=1)
    flags = config.to_flags()
    assert flags == ["--steps", "7", "--lr", "0.0001", "--grad-clip", "0.5", "--metrics-file", "runs/b/metrics.jsonl",
                     "--trace", "--keep", "1", "--straggler-factor", "0.0"]
    parsed = RunConfig.from_flags(vars(build_parser().parse_args(["train", *flags])), plan_toml=config.plan_toml)
    assert parsed == config
    parsed.validate()
    with pytest.raises(SpecError, match="--steps=0: must be at least 1"):
        RunConfig("", steps=0).validate()
    with pytest.raises(SpecError, match="--trace=True: needs --metrics-file"):
        RunConfig("", trace=True).validate()


def test_every_run_config_flag_field_is_a_train_flag_with_the_same_default():
    import dataclasses

    from fivefold.cli import build_parser

    parsed = vars(build_parser().parse_args(["train"]))
    defaults = {f.name: f.default for f in dataclasses.fields(RunConfig)}
    assert {name: parsed.get(name, "missing") for name in RunConfig.flag_fields()} == {
        name: defaults[name] for name in RunConfig.flag_fields()}


def test_uneven_replicas_with_zero2_or_3_and_no_pipeline_are_refused():
    # ZeRO-2/3 reduce every micro-batch: replicas of 1 and 3 micro-batches would issue 1 and 3 collectives.
    for zero in (2, 3):
        plan = make_plan(2, dp=2, zero=zero, micro_batch=2, replica_micro_batches=(1, 3))
        with pytest.raises(SpecError) as caught:
            check_runnable(plan, 2)
        assert caught.value.field == "plan.replica_micro_batches" and "zero 0 or 1" in str(caught.value)
    for zero in (0, 1):  # one reduction per step: runnable
        check_runnable(make_plan(2, dp=2, zero=zero, micro_batch=2, replica_micro_batches=(1, 3)), 2)
