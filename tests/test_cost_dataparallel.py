"""Data-parallel / ZeRO communication: which collectives each stack runs, what they hold up, by hand and
against the simulator's replay of the same mechanism."""

import pytest

from fivefold.cost import STACKS
from fivefold.cost import estimate as _estimate
from fivefold.cost.comm import topology_of
from fivefold.cost.dataparallel import held_passes, sync_seconds
from fivefold.cost.layout import Layout, rank_envs, stage_params
from fivefold.cost.pipeline import pipeline_time
from fivefold.cost.stack import data_parallel_sync
from fivefold.sim import simulate_plan
from fivefold.sim.engine import StageTimes, StepInput, simulate
from fivefold.spec import Plan, TrainSpec, parse_cluster
from fivefold.spec.model import ModelSpec


# These checks describe the mechanisms of the open-ended `modern` stack; the default became `fivefold` (issue 25).
def estimate(plan, stack=None, headroom: float = 0.0):  # type: ignore[no-untyped-def]
    return _estimate(plan, stack or STACKS["modern"], headroom)


def test_which_collectives_each_stack_runs():
    modern, fivefold = STACKS["modern"], STACKS["fivefold"]
    # modern: ZeRO-0/1 reduce once, ZeRO-2/3 every micro-batch; only ZeRO-3 frees weights after passes.
    assert [data_parallel_sync(modern, z, 4).reduce_every_micro_batch for z in range(4)] == [False, False, True, True]
    assert [data_parallel_sync(modern, z, 4).gathers_once for z in range(4)] == [False, True, True, False]
    zero3 = data_parallel_sync(modern, 3, 4)
    assert zero3.reshard_after_forward and zero3.reshard_after_backward and zero3.grads_sharded
    # fivefold without pp: FSDP2 as configured by runtime/parallelize.py; ZeRO-2 frees weights after backward.
    alone = [data_parallel_sync(fivefold, z, 1) for z in range(4)]
    assert [s.reduce_every_micro_batch for s in alone] == [False, False, True, True]
    assert alone[2].reshard_after_backward and not alone[2].reshard_after_forward
    assert all(s.reduce_overlapped for s in alone)
    # fivefold with pp: PipelineStage reduces once, blocking; gradients stay whole; ZeRO-3 keeps weights
    # gathered from a backward until the next forward.
    piped = [data_parallel_sync(fivefold, z, 2) for z in range(4)]
    assert not any(s.reduce_every_micro_batch or s.reduce_overlapped or s.grads_sharded for s in piped)
    assert piped[3].reshard_after_forward and not piped[3].reshard_after_backward and piped[3].keeps_gathered
    assert piped[2].gathers_once
    # Megatron-LM 2022: nothing overlapped.
    old = data_parallel_sync(STACKS["megatron-lm-2022"], 0, 4)
    assert not old.reduce_overlapped and not old.gather_overlapped


def test_zero3_passes_are_held_by_gathers_and_queued_reductions_by_hand():
    """pp=1, m=2, F=1, B=2 over 2 layers, gather 1.0 before every pass, reduce-scatter 0.5 after every
    backward (the engine's hand-computed timeline ends at 8.5): F waits max(G/L, G - F(1-1/L)) = 0.5, B
    max(0.5, 1 - 2 * 0.5) = 0.5, and the next pass's gather queues behind the reduction max(R/L, R - B/2)
    = 0.25: 2 x (1 + 2 + 0.5 + 0.5 + 0.25) = 8.5."""
    sync = data_parallel_sync(STACKS["modern"], 3, 1)
    work = held_passes(sync, (1.0, 2.0, 0.0), 1, 1.0, 2.0, 0.0, 2.0, 0.5, 1.0, False, 2, 1)
    assert work == pytest.approx((1.5, 2.75, 0.0))
    assert pipeline_time("1f1b", 1, 1, 2, [work], 0.0, True).total == pytest.approx(8.5)
    stage = StageTimes(1.0, 2.0, 0.0, grad_reduce=0.5, reduce_every_micro_batch=True, param_gather=1.0,
                       reshard_after_forward=True, reshard_after_backward=True, buckets=2)
    assert simulate(StepInput("1f1b", 1, 1, 2, (stage,))).step_time_s == pytest.approx(8.5)


MODEL = ModelSpec(name="llama-8b-shape", layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=2048)


def _plan(pp: int, schedule: str = "1f1b", virtual: int = 1, zero: int = 0, micro_batches: int = 8) -> Plan:
    dp = 8 // pp
    return Plan(model=MODEL, cluster=parse_cluster("1x8xH100-SXM"), train=TrainSpec(seq_len=4096,
                global_batch=dp * micro_batches), dp=dp, pp=pp, schedule=schedule, virtual_stages=virtual, zero=zero)


def _reduce_and_gather(plan: Plan, stack_name: str, pp_rank: int, layers: int, first: bool, last: bool):
    layout = Layout.of_plan(plan)
    env = rank_envs(layout, topology_of(plan.cluster))[pp_rank]
    dense, expert = stage_params(layout, layers, first, last, holds_embedding=first)
    return sync_seconds(layout, STACKS[stack_name], env, dense, expert)


def test_fivefold_pipeline_reduces_once_after_the_last_backward_and_waits():
    """pp=2 x dp=4, ZeRO-1, 1F1B: under torch.distributed.pipelining every rank reduce-scatters its
    gradients after its last backward while compute waits; rank 0 ends last, so its whole reduction is
    exposed, plus the first layer's share of the once-per-step weight gather before the first forward."""
    plan = _plan(2, zero=1)
    fivefold = estimate(plan, STACKS["fivefold"])
    reduce, gather = _reduce_and_gather(plan, "fivefold", 0, 16, True, False)
    forward = fivefold.stage_costs[0].forward
    head = max(gather / 16, gather - forward * (1 - 1 / 16))
    assert fivefold.dp_comm_exposed_s == pytest.approx(reduce + head, rel=1e-9)
    modern = estimate(plan, STACKS["modern"])  # bucket by bucket under the last backward: one bucket shows
    assert modern.dp_comm_exposed_s < 0.2 * fivefold.dp_comm_exposed_s
    assert simulate_plan(plan, estimate=fivefold).step_time_s == pytest.approx(fivefold.step_time_s, rel=0.01)


def test_interleaved_chunks_reduce_under_the_cooldown():
    """Issue 3: each chunk's gradients are reduced after that chunk's last backward, which comes p
    backwards before the next chunk's; the estimate follows the chunks (so does the simulator)."""
    plan = _plan(2, "interleaved-1f1b", 2, zero=0)
    result = estimate(plan)
    reduce, _ = _reduce_and_gather(plan, "modern", 0, 16, True, False)
    chunk = reduce / 2
    # Rank 0's chunk 1 finishes p=2 chunk-backwards before chunk 0; it is reduced meanwhile, so only chunk 0's
    # last bucket (one of its 8 layers) outlasts the pipeline... unless chunk 0's own reduction is longer
    # than its last backward.
    backward = sum(s.backward_input + s.backward_weight for s in result.stage_costs[:1])
    assert result.dp_comm_exposed_s == pytest.approx(max(chunk / 8, chunk - backward * (1 - 1 / 8)), rel=1e-6)
    simulated = simulate_plan(plan, estimate=result)
    assert simulated.step_time_s == pytest.approx(result.step_time_s, rel=0.01)


def test_zero_bubble_reduces_behind_the_last_w_only():
    """Issue 4: zb-h1's weight gradients exist only after W, so the reduction hides behind the last W, not
    behind B + W, and there is no 1F1B drain slack (rank 0 still ends last when B >= W)."""
    plan = _plan(2, "zb-h1", zero=0)
    result = estimate(plan)
    reduce, _ = _reduce_and_gather(plan, "modern", 0, 16, True, False)
    weight = result.stage_costs[0].backward_weight
    assert result.dp_comm_exposed_s == pytest.approx(max(reduce / 16, reduce - weight * (1 - 1 / 16)), rel=1e-6)
    assert simulate_plan(plan, estimate=result).step_time_s == pytest.approx(result.step_time_s, rel=0.01)


def test_gradient_memory_follows_the_stack():
    """Under pp the fivefold runtime accumulates whole gradients (sync off until the last backward), and
    ZeRO-3 keeps a stage's weights gathered from a backward to the next forward."""
    plan = _plan(2, zero=2)
    modern, fivefold = estimate(plan, STACKS["modern"]), estimate(plan, STACKS["fivefold"])
    # Whole gradients, accumulated in FSDP2's fp32 reduce dtype: 4 bytes against 2 / 4 sharded over dp4.
    assert fivefold.memory.grads == pytest.approx(8 * modern.memory.grads)
    zero3 = plan.replace(zero=3)
    gathered = estimate(zero3, STACKS["fivefold"]).memory
    layer_by_layer = estimate(zero3, STACKS["modern"]).memory
    weights = sum(stage_params(Layout.of_plan(zero3), 16, True, False, holds_embedding=True)) * 2
    # torch.distributed.pipelining also holds a receive buffer per micro-batch: rank 0 for its output's gradient.
    receive_buffers = 8 * 4096 * MODEL.hidden * 2
    assert gathered.transient - layer_by_layer.transient == pytest.approx(
        weights - 2 * sum(stage_params(Layout.of_plan(zero3), 1, False, False)) * 2 + receive_buffers, rel=1e-9)
    # Without pp the fivefold runtime shards gradients like everyone else.
    alone = Plan(model=plan.model, cluster=plan.cluster, train=TrainSpec(seq_len=4096, global_batch=8), dp=8, zero=2)
    assert estimate(alone, STACKS["fivefold"]).memory.grads == pytest.approx(estimate(alone).memory.grads)
