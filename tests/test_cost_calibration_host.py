"""Host costs of the eager runtime on a profiled CPU (Calibration.host): they round-trip through cluster
and plan files, the op and tensor counts match the runtime's own modules, and each cost term adds exactly
the hand-computed seconds to an estimate with the `fivefold` stack, and nothing without a profile."""

import dataclasses

import pytest

from fivefold.cost import estimate
from fivefold.cost.dataparallel import parameter_tensors
from fivefold.cost.eager_ops import eager_ops
from fivefold.cost.stack import STACKS
from fivefold.errors import SpecError
from fivefold.spec import PRESETS, Plan, TrainSpec, load_plan, parse_cluster
from fivefold.spec.cluster import Calibration, ClusterSpec, HostCosts

HOST = HostCosts(op_forward=5e-6, op_backward=7e-6, dtensor_op_forward=50e-6, dtensor_op_backward=40e-6,
                 tp_collective=400e-6,
                 fsdp_unit_forward=300e-6, fsdp_unit_backward=200e-6, fsdp_gather=100e-6, fsdp_reduce=20e-6,
                 optimizer_tensor=30e-6, optimizer_dtensor=150e-6)
GEMMS = ((64, 64, 64, "fp32", 3e10), (512, 512, 512, "fp32", 8e10))
FIVEFOLD = STACKS["fivefold"]
# What the fivefold stack becomes on host-profiled CPU ranks, without charging the host costs.
NO_HOST = dataclasses.replace(STACKS["fivefold-cpu"], eager_host_costs=False)


def cpu_cluster(ranks: int, host: HostCosts | None = HOST) -> ClusterSpec:
    spec = parse_cluster(f"1x{ranks}xcpu")
    calibration = Calibration(GEMMS, (), "test", host, ranks, 1)
    return ClusterSpec((dataclasses.replace(spec.groups[0], calibration=calibration),))


def test_host_costs_round_trip_through_cluster_and_plan_files(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text("""
[[cluster.group]]
nodes = 1
gpus_per_node = 2
device = "cpu"
[cluster.group.calibration]
source = "test"
processes = 2
threads = 1
gemm = [{m = 64, n = 64, k = 64, dtype = "fp32", flops_per_s = 3e10}]
[cluster.group.calibration.host]
op_forward = 5e-6
optimizer_dtensor = 1.5e-4
""")
    calibration = parse_cluster(str(path)).groups[0].calibration
    assert calibration.host == HostCosts(op_forward=5e-6, optimizer_dtensor=1.5e-4)
    assert (calibration.processes, calibration.threads) == (2, 1)
    plan = Plan(model=PRESETS["tiny"], cluster=cpu_cluster(2), train=TrainSpec(global_batch=4, dtype="fp32"), dp=2)
    plan.save(tmp_path / "plan.toml")
    loaded = load_plan(tmp_path / "plan.toml")
    assert loaded == plan and loaded.cluster.groups[0].calibration.host == HOST
    # A file without host costs reads as before: no host costs, nothing recorded about the processes.
    assert Calibration(GEMMS).to_dict().keys() == {"source", "gemm", "collective"}


@pytest.mark.parametrize("bad, field", [("op_forwrd = 1e-6", "calibration.host.op_forwrd"),
                                        ("op_forward = -1e-6", "calibration.host.op_forward"),
                                        ('op_forward = "fast"', "calibration.host.op_forward")])
def test_a_bad_host_cost_names_its_field(tmp_path, bad, field):
    path = tmp_path / "cluster.toml"
    path.write_text(f'[[cluster.group]]\ndevice = "cpu"\n[cluster.group.calibration.host]\n{bad}\n')
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        parse_cluster(str(path))


def _plan(ranks: int, host: HostCosts | None = HOST, **layout) -> Plan:
    return Plan(model=PRESETS["tiny"], cluster=cpu_cluster(ranks, host), train=TrainSpec(global_batch=8, dtype="fp32"),
                **layout)


# Unfused element-wise traffic of a tiny block (h 64, f 128, kv 32) beyond the fused kernels, elements
# per token: 32h + 6f + 5kv forward, 72h + 4f backward; fp32 through the catalog cpu's 20 GB/s (taken as
# achieved on a host-profiled CPU), per token.
TRAFFIC_F = (32 * 64 + 6 * 128 + 5 * 32) * 4 / 20e9
TRAFFIC_B = (72 * 64 + 4 * 128) * 4 / 20e9


def test_each_pass_adds_its_eager_ops_times_the_seconds_per_op():
    plan = _plan(1, micro_batch=2)
    ops = eager_ops(plan.model)
    charged, plain = estimate(plan, FIVEFOLD), estimate(plan, NO_HOST)
    layers, tokens = plan.model.layers, 2 * 128
    forward_ops = layers * ops.layer_forward + ops.embedding_forward + ops.head_forward + ops.stage_forward
    backward_ops = layers * ops.layer_backward + ops.embedding_backward + ops.head_backward
    stage, base = charged.stage_costs[0], plain.stage_costs[0]
    forward = forward_ops * 5e-6 + layers * tokens * TRAFFIC_F
    backward = backward_ops * 7e-6 + layers * tokens * TRAFFIC_B
    assert stage.forward - base.forward == pytest.approx(forward, rel=1e-9)
    assert stage.backward_input - base.backward_input == pytest.approx(backward, rel=1e-9)
    assert stage.backward_weight == base.backward_weight
    assert stage.host_overhead - base.host_overhead == pytest.approx(forward_ops * 5e-6 + backward_ops * 7e-6)
    # Four micro-batches, one rank, nothing else: the step grows by four such passes, plus AdamW's
    # per-tensor cost (plain tensors: one process, no DTensor).
    tensors = parameter_tensors(plan.model, layers, True, True)
    assert charged.step_time_s - plain.step_time_s == pytest.approx(4 * (forward + backward) + tensors * 30e-6,
                                                                    rel=1e-9)
    assert charged.optimizer_s - plain.optimizer_s == pytest.approx(tensors * 30e-6, rel=1e-9)
    # Larger micro-batches pay the per-op cost fewer times: the host term favours them.
    assert estimate(_plan(1, micro_batch=8), FIVEFOLD).step_time_s < charged.step_time_s


def test_data_parallel_adds_fsdp_hooks_gathers_reductions_and_dtensor_adam():
    plan = _plan(2, dp=2, zero=1, micro_batch=2)  # 2 micro-batches per replica
    layers, units = plan.model.layers, plan.model.layers + 1  # each block and the stage model are wrapped
    # ZeRO-1's one reduction a step overlaps the backward on gloo (AsyncReduceScatter): so does the reference's.
    charged, plain = estimate(plan, FIVEFOLD), estimate(plan, dataclasses.replace(NO_HOST, overlap_grad_reduce=True))
    ops = eager_ops(plan.model)
    stage, base = charged.stage_costs[0], plain.stage_costs[0]
    forward_ops = layers * ops.layer_forward + ops.embedding_forward + ops.head_forward + ops.stage_forward
    assert stage.forward - base.forward == pytest.approx(
        forward_ops * 5e-6 + units * 300e-6 + layers * 2 * 128 * TRAFFIC_F, rel=1e-9)
    # ZeRO-1: each wrapped module gathers once and reduces once per step; and the runtime's one small
    # all-reduce of every step (gradient norm, loss, metrics request: 24 bytes) plus the per-rank metrics
    # table (2 ranks x 24 bytes) every 10 steps, on the catalog cpu link: ring over 2 ranks,
    # 2 (n-1) x 50 us + 2 (n-1)/n x bytes / (0.8 x 5 GB/s).
    bookkeeping = 100e-6 + 24 / 4e9 + (100e-6 + 48 / 4e9) / 10
    # FSDP2's copies around each collective: the fp32 parameters (gathers) or gradients (reductions) and their
    # half, each read and written, at the profile's 20 GB/s.
    copies = 2 * plan.model.num_params() * 4 * 1.5 / 20e9
    assert charged.dp_comm_exposed_s - plain.dp_comm_exposed_s == pytest.approx(
        units * (100e-6 + 20e-6) + 2 * copies + bookkeeping, rel=1e-6)
    tensors = parameter_tensors(plan.model, layers, True, True)
    assert charged.optimizer_s - plain.optimizer_s == pytest.approx(tensors * 150e-6, rel=1e-9)
    # ZeRO-3 gathers before every forward and every backward: 2 x 2 micro-batches.
    zero3 = _plan(2, dp=2, zero=3, micro_batch=2)
    extra = estimate(zero3, FIVEFOLD).dp_comm_exposed_s - estimate(zero3, NO_HOST).dp_comm_exposed_s
    assert extra == pytest.approx(units * (4 * 100e-6 + 2 * 20e-6) + 6 * copies + bookkeeping, rel=1e-6)


def test_ddp_keeps_plain_parameters_for_adamw():
    """ZeRO-0 data parallelism runs under DistributedDataParallel on CPU: AdamW steps plain tensors."""
    plan = _plan(2, dp=2, zero=0, micro_batch=2)
    tensors = parameter_tensors(plan.model, plan.model.layers, True, True)
    assert estimate(plan, FIVEFOLD).optimizer_s - estimate(plan, NO_HOST).optimizer_s == pytest.approx(
        tensors * 30e-6, rel=1e-9)


def test_on_cpu_ranks_fsdp_collectives_go_module_by_module_and_hide_under_nothing():
    plan = _plan(2, dp=2, zero=1, micro_batch=4)
    assert estimate(plan, FIVEFOLD).stack == "fivefold-cpu"
    assert estimate(_plan(2, None, dp=2, zero=1, micro_batch=4), FIVEFOLD).stack == "fivefold"
    plain = estimate(plan, NO_HOST)
    # Each of the 5 wrapped modules (4 blocks, the model) reduce-scatters and all-gathers its fifth of the
    # fp32 parameters on the catalog cpu link: (n-1) x 50 us + (n-1)/n x bytes / (0.8 x 5 GB/s), n = 2.
    piece = PRESETS["tiny"].num_params() / 5 * 4
    one = 50e-6 + 0.5 * piece / 4e9
    assert plain.dp_comm_s == pytest.approx(5 * one * 2, rel=1e-9)
    # Not overlapped: the first forward waits for every gather, the step for every reduction.
    assert plain.dp_comm_exposed_s == pytest.approx(plain.dp_comm_s, rel=1e-9)


def test_tensor_parallel_passes_pay_dtensor_dispatch():
    plan = _plan(2, tp=2, sequence_parallel=True, micro_batch=8)
    ops = eager_ops(plan.model)
    charged, plain = estimate(plan, FIVEFOLD), estimate(plan, NO_HOST)
    forward_ops = plan.model.layers * ops.layer_forward + ops.embedding_forward + ops.head_forward + ops.stage_forward
    # Each TP rank moves half of the unfused traffic of its 8 x 128 tokens; with sequence parallelism
    # every block all-gathers and reduce-scatters around attention and MLP (4 collectives), the embedding
    # reduce-scatters its output (1), the head gathers its input and the logits (2), at 400 us each beyond
    # the collectives themselves.
    traffic = plan.model.layers * 8 * 128 / 2 * TRAFFIC_F
    collectives = 4 * plan.model.layers + 1 + 2
    assert charged.stage_costs[0].forward - plain.stage_costs[0].forward == pytest.approx(
        forward_ops * 50e-6 + traffic + collectives * 400e-6, rel=1e-9)
    # Without sequence parallelism: 2 all-reduces per block forward, 5 backward (q, k, v and w1, w3's input
    # gradients each on its own), the embedding's 1 forward, the head's logits gather 1 and 1 backward.
    plain_tp = _plan(2, tp=2, sequence_parallel=False, micro_batch=8)
    backward_ops = plan.model.layers * ops.layer_backward + ops.embedding_backward + ops.head_backward
    extra = (estimate(plain_tp, FIVEFOLD).stage_costs[0].backward_input
             - estimate(plain_tp, NO_HOST).stage_costs[0].backward_input)
    assert extra == pytest.approx(backward_ops * 40e-6 + plan.model.layers * 8 * 128 / 2 * TRAFFIC_B
                                  + (5 * plan.model.layers + 0 + 1) * 400e-6, rel=1e-9)


def test_pipeline_stages_pay_their_own_ends():
    plan = _plan(2, pp=2, schedule="1f1b", micro_batch=2)
    ops = eager_ops(plan.model)
    charged, plain = estimate(plan, FIVEFOLD), estimate(plan, NO_HOST)
    first, last = (c.forward - p.forward for c, p in zip(charged.stage_costs, plain.stage_costs))
    traffic = 2 * 2 * 128 * TRAFFIC_F  # two layers of 2 x 128 tokens
    assert first == pytest.approx((2 * ops.layer_forward + ops.embedding_forward + ops.stage_forward) * 5e-6 + traffic)
    assert last == pytest.approx((2 * ops.layer_forward + ops.head_forward + ops.stage_forward) * 5e-6 + traffic)


def test_zero_bubble_split_backward_charges_every_stage_but_the_first():
    """zbv on 2 ranks, tiny's 4 layers: 4 stages of 1 layer (V: rank 0 holds stages 0 and 3, rank 1 stages 1
    and 2); every stage but the first pays its layers' graph walks in its W pass, 1F1B pays none."""
    split = dataclasses.replace(HOST, split_backward_layer=1e-3, split_backward_layer_pair=2e-4)
    plan = _plan(2, split, pp=2, schedule="zbv", virtual_stages=2, micro_batch=2)
    charged = estimate(plan, FIVEFOLD)
    plain = estimate(_plan(2, HOST, pp=2, schedule="zbv", virtual_stages=2, micro_batch=2), FIVEFOLD)
    extra = [c.backward_weight - p.backward_weight for c, p in zip(charged.stage_costs, plain.stage_costs)]
    assert extra == pytest.approx([0.0, 1e-3, 1e-3, 1e-3], rel=1e-9)
    assert [c.backward_input for c in charged.stage_costs] == [p.backward_input for p in plain.stage_costs]
    # 2 stages of 2 layers (zb-h1): 2 layers and their 1 pair on the second stage.
    two = [estimate(_plan(2, host, pp=2, schedule="zb-h1", micro_batch=2), FIVEFOLD).stage_costs[1].backward_weight
           for host in (split, HOST)]
    assert two[0] - two[1] == pytest.approx(2 * 1e-3 + 2e-4, rel=1e-9)
    # The split costs more step time than the same pipeline without it; 1F1B does not split.
    assert charged.step_time_s > plain.step_time_s
    one_f_one_b = [estimate(_plan(2, host, pp=2, schedule="1f1b", micro_batch=2), FIVEFOLD).step_time_s
                   for host in (split, HOST)]
    assert one_f_one_b[0] == one_f_one_b[1]


def test_without_host_costs_nothing_changes():
    """A profile without host costs (a GPU, or an older file): the eager stack charges nothing; on a
    host-profiled CPU the other stacks charge no host costs either."""
    with_host, without = _plan(2, dp=2, zero=1), _plan(2, None, dp=2, zero=1)
    not_eager = dataclasses.replace(FIVEFOLD, eager_host_costs=False)
    assert estimate(without, FIVEFOLD).to_dict() == estimate(without, not_eager).to_dict()
    # ZeRO-1 over 2 replicas: AdamW sweeps half the parameters at 36 bytes each through the measured
    # bandwidth (the catalog cpu's 20 GB/s here), with no per-tensor cost for a stack that is not eager.
    half = PRESETS["tiny"].num_params() / 2
    for name in ("modern", "megatron-core", "megatron-lm-2022"):
        assert estimate(with_host, STACKS[name]).optimizer_s == pytest.approx(half * 36 / 20e9, rel=1e-9)
    # The host-profiled CPU takes the measured memory bandwidth as achieved and adds no kernel latency.
    from fivefold.cost.compute import Device

    calibrated = Device(with_host.cluster.groups[0].device, "fp32", with_host.cluster.groups[0].calibration)
    catalog = Device(without.cluster.groups[0].device, "fp32", without.cluster.groups[0].calibration)
    assert calibrated.latency == 0.0 and catalog.latency == 20e-6
    assert calibrated.bandwidth == pytest.approx(20e9) and catalog.bandwidth == pytest.approx(0.6 * 20e9)


def test_cost_model_and_runtime_agree_on_which_plans_run_under_ddp() -> None:
    import torch

    from fivefold.cost.host import ddp_on_cpu
    from fivefold.cost.layout import Layout
    from fivefold.runtime.parallelize import uses_ddp
    from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

    train = TrainSpec(seq_len=64, global_batch=8, dtype="fp32")
    cases = [("tiny", dict(dp=4)), ("tiny", dict(dp=2, cp=2)), ("tiny", dict(dp=2, cp=2, zero=1)),
             ("tiny", dict(dp=2, tp=2)), ("tiny", dict(dp=2, pp=2)), ("tiny", dict(dp=2, tp=2, zero=1)),
             ("tiny-moe", dict(dp=4)), ("tiny-moe", dict(dp=4, ep=4)), ("tiny-moe", dict(dp=4, ep=2)),
             ("tiny-moe", dict(dp=2, cp=2, ep=4)), ("tiny-moe", dict(dp=4, etp=4)), ("tiny-moe", dict(dp=4, ep=2, etp=2)),
             ("tiny-moe", dict(dp=2, tp=2, ep=2))]
    for model, fields in cases:
        plan = Plan(model=PRESETS[model], cluster=parse_cluster("1x4xcpu"), train=train, **fields)
        assert ddp_on_cpu(Layout.of_plan(plan)) == uses_ddp(plan, torch.device("cpu")), (model, fields)


@pytest.mark.parametrize("layout, overlapped", [(dict(dp=2, zero=0, micro_batch=2), True),  # DDP's buckets
                                                (dict(dp=2, zero=1, micro_batch=2), True),  # one async reduce-scatter
                                                (dict(dp=2, zero=3, micro_batch=4), True),
                                                (dict(dp=2, zero=3, micro_batch=2), False),  # 2nd adds in at once
                                                (dict(dp=2, zero=0, tp=2, micro_batch=4), False),  # replicate
                                                (dict(pp=2, dp=2, zero=1, micro_batch=2), False)])  # deferred
def test_cpu_reductions_overlap_the_backward_where_the_runtime_overlaps_them(layout, overlapped):
    from fivefold.cost.host import stack_on_profiled_cpu
    from fivefold.cost.layout import Layout

    plan = _plan(2 * layout.get("tp", 1) * layout.get("pp", 1), **layout)
    assert stack_on_profiled_cpu(Layout.of_plan(plan), FIVEFOLD).overlap_grad_reduce is overlapped


def test_an_overlapped_reduction_charges_its_measured_in_series_part():
    """DDP's all-reduce overlaps the backward, but on CPU ranks the profile's overlapped_collective factor of
    its byte-moving part (the collective less its one-element latency) is paid in series."""
    from types import SimpleNamespace

    from fivefold.cost.comm import all_reduce_time, topology_of
    from fivefold.cost.dataparallel import in_series_reduction
    from fivefold.cost.layout import Layout, rank_envs

    def plan_with(factor: float) -> Plan:
        host = dataclasses.replace(HOST, overlapped_collective=factor)
        return Plan(model=PRESETS["tiny"], cluster=cpu_cluster(2, host), train=TrainSpec(global_batch=4, dtype="fp32"),
                    dp=2, zero=0, micro_batch=2)

    measured = plan_with(0.8)
    layout = Layout.of_plan(measured)
    group = SimpleNamespace(env=rank_envs(layout, topology_of(measured.cluster))[0], dense=measured.model.num_params(),
                            expert=0)
    link = group.env.replicas
    reduce = all_reduce_time(group.dense * 4, link)
    assert reduce > 0
    series = in_series_reduction(layout, FIVEFOLD, group, 1, reduce)
    # The catalog link's ring: 2 (n-1) x latency + 2 (n-1)/n x bytes / bandwidth; the latency overlaps.
    assert series == pytest.approx(0.8 * (reduce - all_reduce_time(4, link)), rel=1e-9)
    assert series == pytest.approx(0.8 * (group.dense - 1) * 4 / link.ring_bandwidth, rel=1e-9)
    charged, hidden = estimate(measured, FIVEFOLD), estimate(plan_with(0.0), FIVEFOLD)
    # What is in series no longer queues beside the backward: the step grows by the series part, less at most
    # the queue's share that the overlapped version left exposed.
    grown = charged.step_time_s - hidden.step_time_s
    assert series - reduce / measured.model.layers <= grown <= series + 1e-12
