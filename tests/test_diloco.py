"""DiLoCo and Streaming DiLoCo (runtime/diloco.py): exact against references, fp32 on CPU.

- one outer group, outer SGD lr 1, momentum 0 == plain synchronous training (per-step loss within 1e-5);
- two groups, H = 1, lr 1, momentum 0 == LocalSGD: two models, each trained on its half of the global batch,
  averaged after every step, computed here in the test process;
- after every sync every group holds the same weights (outer_weights_spread == 0);
- with fragments, fragment p starts its exchange after step s with s % H == offset_p and applies it T later;
- dp_sync_bytes is recorded for synchronous DP and DiLoCo;
- the held-out loss (--eval-data) of two groups is the loss of their (synced) weights on the eval batches.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fivefold.errors import SpecError
from fivefold.runtime import RunConfig
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster
from fivefold.spec.diloco import DiLoCoSpec, applies_at, fragment_offset, outer_groups, sends_at

STEPS = 6
RTOL = 1e-5
SEQ, BATCH = 32, 8


def make_plan(world: int = 2, cluster: str | None = None, **fields) -> Plan:
    return Plan(model=PRESETS["tiny"], cluster=parse_cluster(cluster or f"1x{world}xcpu"),
                train=TrainSpec(seq_len=SEQ, global_batch=BATCH, dtype="fp32"), **fields)


# --- torch-free parts --------------------------------------------------------------------------------

def test_fragment_schedule():
    spec = DiLoCoSpec(groups=2, sync_every=4, fragments=2, overlap=1)
    assert [fragment_offset(p, 4, 2) for p in range(2)] == [2, 0]
    assert [sends_at(s, spec) for s in range(1, 9)] == [[], [0], [], [1], [], [0], [], [1]]
    assert [applies_at(s, spec) for s in range(1, 10)] == [[], [], [0], [], [1], [], [0], [], [1]]
    plain = DiLoCoSpec(groups=2, sync_every=3)
    assert [s for s in range(1, 10) if sends_at(s, plain)] == [3, 6, 9]
    assert [s for s in range(1, 10) if applies_at(s, plain)] == [3, 6, 9]


def test_outer_groups_default_to_the_clusters_groups():
    assert outer_groups(make_plan(cluster="1x2xcpu+1x2xcpu", dp=4), 0) == 2
    assert outer_groups(make_plan(4, dp=4), 0) == 2  # no + groups: 2
    assert outer_groups(make_plan(4, dp=4), 4) == 4
    with pytest.raises(SpecError, match="--diloco-groups=3: must divide"):
        outer_groups(make_plan(4, dp=4), 3)
    with pytest.raises(SpecError, match="--diloco-groups=0: needs a value"):
        outer_groups(make_plan(3, dp=3, micro_batch=1, replica_micro_batches=(3, 3, 2)), 0)


@pytest.mark.parametrize("flags, message", [
    (dict(sync_every=5), "--sync-every=5: needs --dp-sync diloco"),
    (dict(dp_sync="diloco", fragments=3, sync_every=2), "--fragments=3: must be 1 to --sync-every"),
    (dict(dp_sync="diloco", overlap=2, sync_every=4, fragments=2), "--overlap=2: must be 0 to 1"),
    (dict(dp_sync="diloco", outer_momentum=1.0), "--outer-momentum=1.0: must be from 0 to below 1"),
    (dict(dp_sync="diloco", outer_lr=0.0), "--outer-lr=0.0: must be a positive"),
])
def test_flags_are_checked(flags, message):
    with pytest.raises(SpecError, match=message.replace("+", r"\+")):
        RunConfig("", **flags).validate()


def test_outer_step_is_nesterov_sgd():
    import torch

    from fivefold.runtime.diloco import OuterLoop

    weight = torch.nn.Parameter(torch.arange(6, dtype=torch.float32))
    loop = OuterLoop(DiLoCoSpec(groups=1, sync_every=1, outer_lr=0.7, outer_momentum=0.9), [("w", weight)], None, 0)
    reference = torch.nn.Parameter(weight.detach().clone())
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    for step in range(1, 4):
        with torch.no_grad():
            weight.sub_(0.1 * step * torch.ones(6))  # an inner step
        reference.grad = reference.detach() - weight.detach()  # outer gradient
        sgd.step()
        loop.after_step(step)
        torch.testing.assert_close(weight.detach(), reference.detach(), rtol=0, atol=1e-6)


# --- runs ------------------------------------------------------------------------------------------

def local_sgd_reference(lr: float, grad_clip: float, warmup: int,
                        eval_data: str | None = None) -> tuple[list[float], float]:
    """Two models from the same seeded weights, each trained with AdamW on its half of every global batch
    (loss over its own tokens, clipped by its own norm), their weights averaged after every step; the mean
    of the two losses per step, and the averaged model's mean loss on the first 4 global batches of
    `eval_data` (as runtime/evaluate.py draws them; nan without)."""
    import torch
    import torch.nn.functional as F

    from fivefold.data import GlobalBatchLoader, load_tokenizer, open_dataset
    from fivefold.models import init_weights
    from fivefold.runtime.optim import build_optimizer, set_lr
    from fivefold.runtime.schedule import lr_at
    from fivefold.runtime.pipeline import build_stage_model

    plan = make_plan(1)
    models = []
    for _ in range(2):
        model = build_stage_model(plan, 0)
        model.to_empty(device="cpu")
        init_weights(model, 0)
        models.append(model)
    optimizers = [build_optimizer(list(m.parameters()), lr) for m in models]
    loader = GlobalBatchLoader(open_dataset(None, load_tokenizer(None)), seq_len=SEQ, global_batch=BATCH, seed=0)
    losses = []
    half = BATCH // 2
    for step in range(STEPS):
        batch = loader.next_batch()
        step_losses = []
        for group, (model, optimizer) in enumerate(zip(models, optimizers)):
            set_lr(optimizer, lr_at(step, lr, warmup, STEPS))
            rows = batch[group * half:(group + 1) * half]
            logits = model(rows[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten(), reduction="sum") / (half * SEQ)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_losses.append(loss.item())
        with torch.no_grad():
            for a, b in zip(models[0].parameters(), models[1].parameters()):
                mean = (a + b) / 2
                a.copy_(mean)
                b.copy_(mean)
        losses.append(sum(step_losses) / 2)
    if eval_data is None:
        return losses, float("nan")
    from fivefold.data import open_data

    held_out = GlobalBatchLoader(open_data(eval_data, load_tokenizer(None), "text"), seq_len=SEQ, global_batch=BATCH,
                                 seed=0)
    with torch.no_grad():
        batches = [held_out.next_batch() for _ in range(4)]
        eval_losses = [F.cross_entropy(models[0](b[:, :-1]).flatten(0, 1).float(), b[:, 1:].flatten()).item()
                       for b in batches]
    return losses, sum(eval_losses) / len(eval_losses)


@pytest.fixture(scope="module")
def heldout(tmp_path_factory) -> str:
    """40 stories of the built-in grammar drawn with another seed than the training corpus's."""
    from fivefold.data.corpus import builtin_documents

    path = tmp_path_factory.mktemp("heldout") / "heldout.txt"
    path.write_text("\n\n".join(builtin_documents(40, seed=1)) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, heldout) -> dict[str, list[dict]]:
    from fivefold.runtime import launch

    folder = tmp_path_factory.mktemp("diloco")
    plan = make_plan(2, dp=2, micro_batch=2)
    configs = {
        "sync": dict(),
        "one-group": dict(dp_sync="diloco", diloco_groups=1, sync_every=2, outer_lr=1.0, outer_momentum=0.0),
        "local-sgd": dict(dp_sync="diloco", diloco_groups=2, sync_every=1, outer_lr=1.0, outer_momentum=0.0,
                          eval_data=heldout),
        "streaming": dict(dp_sync="diloco", sync_every=4, fragments=2, overlap=1, outer_dtype="bf16"),
    }
    outer = dict(dp_sync="diloco", sync_every=2)
    configs["saved"] = dict(outer, checkpoint_every=2, checkpoint_dir=str(folder / "ckpt"))
    runs = [RunConfig(plan.to_toml(), steps=STEPS, seed=0, device="cpu", show_progress=False,
                      metrics_file=str(folder / f"{name}.jsonl"), **flags) for name, flags in configs.items()]
    # Resumed at step 4 under another inner layout (FSDP, one sequence per micro-batch).
    configs["resumed"] = {}
    other = make_plan(2, dp=2, zero=3, micro_batch=1)
    runs.append(RunConfig(other.to_toml(), steps=STEPS, seed=0, device="cpu", show_progress=False,
                          metrics_file=str(folder / "resumed.jsonl"), resume_from=str(folder / "ckpt" / "step-00000004"),
                          **outer))
    launch(runs, 2)
    return {name: [json.loads(line) for line in Path(folder / f"{name}.jsonl").read_text().splitlines()]
            for name in configs}


@pytest.mark.slow
def test_one_group_is_plain_training(runs):
    for plain, diloco in zip(runs["sync"], runs["one-group"], strict=True):
        assert diloco["loss"] == pytest.approx(plain["loss"], rel=RTOL)
        assert diloco["grad_norm"] == pytest.approx(plain["grad_norm"], rel=RTOL)
    assert [r.get("outer_applied") for r in runs["one-group"]] == [None, [0], None, [0], None, [0]]


@pytest.mark.slow
def test_two_groups_every_step_is_local_sgd(runs, heldout):
    config = RunConfig("")
    reference, held_out = local_sgd_reference(config.lr, config.grad_clip, config.warmup_steps, heldout)
    assert [r["loss"] for r in runs["local-sgd"]] == pytest.approx(reference, rel=RTOL)
    assert all(r["outer_weights_spread"] == 0.0 for r in runs["local-sgd"])
    # Evaluated after the last step (each group its half of the rows, with the synced weights): the groups'
    # shares are averaged, not added (they were added before, doubling the loss).
    assert [r["step"] for r in runs["local-sgd"] if "eval_loss" in r] == [STEPS]
    assert runs["local-sgd"][-1]["eval_loss"] == pytest.approx(held_out, rel=RTOL)


@pytest.mark.slow
def test_inner_layouts_reduce_inside_their_group(tmp_path):
    """dp 4 as 2 groups of 2 FSDP replicas, and dp 2 x tp 2 as 2 groups: still LocalSGD of the two halves."""
    from fivefold.runtime import launch

    plans = {"fsdp": make_plan(4, dp=4, zero=3, micro_batch=1), "tp": make_plan(4, dp=2, tp=2, micro_batch=4)}
    launch([RunConfig(plan.to_toml(), steps=STEPS, seed=0, device="cpu", show_progress=False,
                      metrics_file=str(tmp_path / f"{name}.jsonl"), dp_sync="diloco", sync_every=1, outer_lr=1.0,
                      outer_momentum=0.0) for name, plan in plans.items()], 4)
    config = RunConfig("")
    reference, _ = local_sgd_reference(config.lr, config.grad_clip, config.warmup_steps)
    for name in plans:
        records = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert [r["loss"] for r in records] == pytest.approx(reference, rel=RTOL), name
        assert all(r["outer_weights_spread"] == 0.0 for r in records)
        if name == "fsdp":
            replica = 4 * PRESETS["tiny"].num_params()  # fp32 bytes
            inner = 3 * 2 * replica * (2 - 1) / 2  # 3 ring passes per micro-batch (2 of them) over 2 ranks
            outer = replica / 2  # an all-reduce of this rank's half over the 2 groups
            assert records[0]["dp_sync_bytes"] == pytest.approx(inner + outer, rel=1e-6)


@pytest.mark.slow
def test_fragments_sync_on_their_schedule(runs):
    records = runs["streaming"]
    assert [r.get("outer_sent", []) for r in records] == [[], [0], [], [1], [], [0]]
    assert [r.get("outer_applied", []) for r in records] == [[], [], [0], [], [1], []]
    assert all(r["outer_weights_spread"] == 0.0 for r in records if "outer_applied" in r)


@pytest.mark.slow
def test_resume_under_another_inner_plan(runs):
    """Outer weights, momentum and each group's own weights and AdamW state come back from the checkpoint."""
    resumed = runs["resumed"]
    assert [r["step"] for r in resumed] == [5, 6]
    for saved, again in zip(runs["saved"][4:], resumed, strict=True):
        assert again["loss"] == pytest.approx(saved["loss"], rel=RTOL)
        assert again["grad_norm"] == pytest.approx(saved["grad_norm"], rel=RTOL)


@pytest.mark.slow
def test_dp_sync_bytes(runs):
    params = PRESETS["tiny"].num_params()
    # Synchronous DDP over 2 ranks: one ring all-reduce of fp32 gradients, (2-1)/2 * 2 passes = the buffer.
    assert all(r["dp_sync_bytes"] == pytest.approx(4 * params, rel=1e-6) for r in runs["sync"])
    # Streaming, bf16, one rank per group: nothing inside a group; one fragment's bf16 buffer when it is sent.
    sent = {r["step"]: r["dp_sync_bytes"] for r in runs["streaming"]}
    assert sent[1] == sent[3] == sent[5] == 0
    assert sent[2] + sent[4] == pytest.approx(2 * params, rel=1e-6)


def test_train_refuses_groups_that_do_not_split_dp(tmp_path):
    """The plan-level check runs before any worker starts and writes nothing."""
    import subprocess
    import sys

    metrics = tmp_path / "run" / "metrics.jsonl"
    done = subprocess.run([sys.executable, "-m", "fivefold", "train", "--model", "tiny", "--cluster", "1x2xcpu",
                           "--dp", "2", "--seq-len", "32", "--dp-sync", "diloco", "--diloco-groups", "4",
                           "--metrics-file", str(metrics)], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: --diloco-groups=4: must divide the plan's dp=2 (outer replicas are "
                                   "blocks of dp replicas)")
    assert not metrics.parent.exists()
