"""Mixed clusters in the planner: the `speed` key, placements, work in proportion to speed and memory,
the cost of uneven replicas, and the explanation `fivefold plan` prints (no torch here)."""

import dataclasses
import tomllib

import pytest

from fivefold.cli import main
from fivefold.cost import STACKS, Layout
from fivefold.cost import estimate as _estimate
from fivefold.cost.stack import STACKS
from fivefold.errors import SpecError
from fivefold.planner import Choices, balanced_layers
from fivefold.planner import search as _search
from fivefold.planner.mixed import REPLICAS, STAGES, is_mixed, placement_options, speed_balanced_layers
from fivefold.planner.space import balanced_replicas
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster
from fivefold.spec.cluster import cluster_from_dict


# These checks describe the mechanisms of the open-ended `modern` stack; the default became `fivefold` (issue 25).
def estimate(plan, stack=None, headroom: float = 0.0):  # type: ignore[no-untyped-def]
    return _estimate(plan, stack or STACKS["modern"], headroom)


def search(*args, **fields):  # type: ignore[no-untyped-def]
    return _search(*args, **{"stack": STACKS["modern"], **fields})


CPU_TRAIN = TrainSpec(seq_len=32, global_batch=8, dtype="fp32")
MIXED_TOML = """between_groups = "100Gb/s"
[[group]]
nodes = 2
gpus_per_node = 8
device = "A100-80GB"
[[group]]
nodes = 2
gpus_per_node = 8
device = "H100-SXM"
"""


def test_speed_key_scales_flops_and_memory_bandwidth_and_round_trips():
    cluster = parse_cluster("1x2xcpu+1x2xcpu:speed=0.25")
    fast, slow = (g.device for g in cluster.groups)
    assert slow.peak_flops["fp32"] == pytest.approx(fast.peak_flops["fp32"] / 4)
    assert slow.memory_bandwidth == pytest.approx(fast.memory_bandwidth / 4)
    assert slow.memory_bytes == fast.memory_bytes and not cluster.is_homogeneous
    again = cluster_from_dict(cluster.to_dict())  # written out as explicit peak_tflops / memory_bandwidth
    assert again.groups[1].device.peak_flops == slow.peak_flops
    toml = cluster_from_dict({"group": [{"device": "H100-SXM", "nodes": 1, "speed": 0.5}]})
    assert toml.groups[0].device.flops("bf16") == pytest.approx(989.4e12 / 2)
    for bad in ("1x2xcpu:speed=0", "1x2xcpu:speed=fast"):
        with pytest.raises(SpecError, match="speed"):
            parse_cluster(bad)


def test_which_clusters_are_mixed():
    assert not is_mixed(parse_cluster("4x8xH100-SXM"))
    assert not is_mixed(parse_cluster("2x8xH100-SXM+2x8xH100-SXM"))  # two identical groups
    assert is_mixed(parse_cluster("2x8xA100-80GB+2x8xH100-SXM"))
    assert is_mixed(parse_cluster("2x8xH100-SXM+2x8xH100-SXM:nic=100Gb/s"))  # same GPU, slower network
    same = parse_cluster("1x8xH100-SXM+1x8xH100-SXM")
    assert is_mixed(dataclasses.replace(same, between_groups_bandwidth=12.5e9))


def test_placements_by_hand():
    # Groups of 2 devices (0-1 fast, 2-3 slow); dp2 x pp2, ranks pipeline-major: rank = pp * 2 + dp.
    cluster = parse_cluster("1x2xcpu+1x2xcpu:speed=0.5")
    options = placement_options(cluster, dp=2, tp=1, pp=2, cp=1)
    assert [(o.kind, o.order) for o in options] == [(STAGES, (0, 1)), (STAGES, (1, 0)), (REPLICAS, (0, 1))]
    assert options[0].devices == ()  # identity: stage 0 on the fast pair, stage 1 on the slow pair
    assert options[1].devices == (2, 3, 0, 1)  # stage 0 on the slow pair
    # Replica d on devices 2d, 2d+1: rank(pp=0, dp=1) = 1 -> device 2, rank(pp=1, dp=0) = 2 -> device 1.
    assert options[2].devices == (0, 2, 1, 3)
    # Without a pipeline there is nothing to order: replicas on groups, identity placement.
    assert [(o.kind, o.devices) for o in placement_options(cluster, 4, 1, 1, 1)] == [(REPLICAS, ())]


def test_layers_and_replicas_in_proportion_to_speed():
    # Equal speeds: the old even split (leftovers to the middle), so one device type plans as before.
    assert balanced_layers(10, 4, 0.0, 0.0, layer_time=[1.0] * 4) == balanced_layers(10, 4, 0.0, 0.0) == (2, 3, 3, 2)
    # Two ranks 1.6x slower per layer: 15 x 1.6 = 24 and 25 x 1 = 25, so the busiest rank does 25 (the
    # least possible: 80 layers over speeds 1/1.6 + 1/1.6 + 1 + 1 = 3.25 need at least 24.6).
    assert balanced_layers(80, 4, 0.0, 0.0, layer_time=[1.6, 1.6, 1.0, 1.0]) == (15, 15, 25, 25)
    # A memory cap of 20 on rank 2 moves layers to the ranks with room: 60 left for two ranks at 1.6 and
    # one at 1.0 need T >= 60 / (2 / 1.6 + 1) = 26.7; the best whole split is 17 x 1.6 = 27.2 and 27.
    # Caps below one layer per stage leave no split.
    assert balanced_layers(80, 4, 0.0, 0.0, layer_time=[1.6, 1.6, 1.0, 1.0], max_layers=[80, 80, 20, 80]) == (
        16, 17, 20, 27)
    assert balanced_layers(8, 4, 0.0, 0.0, max_layers=[1, 1, 1, 1]) is None
    # Replicas: 8 micro-batches, one replica 3x slower: 2 x 3 = 6 = 6 x 1.
    assert balanced_replicas(8, [3.0, 1.0]) == (2, 6)
    assert balanced_replicas(8, [3.0, 1.0], unit=4) == (4, 4)  # rounds of 4 (interleaved with pp=4)
    assert balanced_replicas(8, [3.0, 1.0], minimum=3) == (3, 5)  # 1F1B needs one per stage
    assert balanced_replicas(4, [1.0, 1.0], minimum=3) is None


def test_uneven_replicas_are_costed_on_the_replica_that_finishes_last():
    model = PRESETS["tiny"]
    mixed = parse_cluster("1x1xcpu+1x1xcpu:speed=0.5")
    fast_pair, slow_pair = parse_cluster("1x2xcpu"), parse_cluster("1x2xcpu:speed=0.5")

    def pipeline(cluster, counts=()):
        return estimate(Plan(model=model, cluster=cluster, train=CPU_TRAIN, dp=2, replica_micro_batches=counts))

    even_fast, even_slow = pipeline(fast_pair), pipeline(slow_pair)  # 4 micro-batches each
    # 6 on the fast device and 2 on the half-speed one: the fast replica finishes last (6 > 2 x 2).
    paced_by_fast = pipeline(mixed, (6, 2))
    assert paced_by_fast.micro_batches == 6
    assert paced_by_fast.pipeline_s == pytest.approx(even_fast.pipeline_s * 6 / 4, rel=1e-12)
    # 5 and 3: now the slow replica sets the pace (3 x 2 > 5), with its device's speed.
    paced_by_slow = pipeline(mixed, (5, 3))
    assert paced_by_slow.micro_batches == 3
    assert paced_by_slow.pipeline_s == pytest.approx(even_slow.pipeline_s * 3 / 4, rel=1e-12)


def test_cpu_mixed_cluster_gives_the_fast_devices_more_work_and_beats_the_naive_plan():
    model, choices = PRESETS["small"], Choices(cp=1, tp=1)
    mixed = parse_cluster("1x2xcpu+1x2xcpu:speed=0.33")
    aware = search(model, mixed, CPU_TRAIN, choices, top=3)
    naive_layout = search(model, parse_cluster("1x4xcpu"), CPU_TRAIN, choices, top=1).candidates[0].plan
    naive = estimate(dataclasses.replace(naive_layout, cluster=mixed))  # the same layout on the real hardware
    best = aware.candidates[0]
    assert best.estimate.step_time_s < 0.75 * naive.step_time_s
    plan, slots = best.plan, mixed.slots()
    work = {0: 0.0, 1: 0.0}  # layers x micro-batches done per device group
    for rank in range(plan.world_size):
        coords = plan.coords(rank)
        layers = sum(plan.layers_per_stage[s] for s in plan.stages_of(coords["pp"]))
        work[slots[plan.placement[rank]].group] += layers * plan.micro_batches_of_replica(coords["dp"])
    assert work[0] > 2 * work[1]  # the fast group does most of the work (it is 3x faster)
    assert aware.placement and aware.placement[0].startswith("placement: ")


def test_a100_h100_worked_example_keeps_gradients_off_the_slow_link():
    cluster = cluster_from_dict(tomllib.loads(MIXED_TOML))
    result = search(PRESETS["llama3-70b"], cluster, TrainSpec(seq_len=4096, global_batch=64), top=3)
    best = result.candidates[0].plan
    placement, why = result.placement[0], result.placement[1]
    # Stages on groups: A100 stages first, H100 stages after, more layers on the faster H100s.
    assert placement.startswith("placement: stages 0-1 (") and "on 2x8xA100-80GB, stages 2-3 (" in placement
    a100_layers = sum(best.layers_per_stage[s] for r in (0, 1) for s in best.stages_of(r))
    assert a100_layers < best.model.layers / 2
    assert "100 Gb/s link between the groups carries only pipeline sends" in why and "gradient reduction" in why
    sends = float(why.split("pipeline sends (")[1].split(" ms")[0]) / 1e3
    reduction = float(why.split("gradient reduction (")[1].split(" s/step")[0])
    assert reduction > 5 * sends  # what the slow link would carry with replicas on groups instead
    assert any(line.startswith("balance: layers per stage") for line in result.placement)
    even = estimate(dataclasses.replace(best, layers_per_stage=(20,) * best.num_stages))
    assert result.candidates[0].estimate.step_time_s < 0.8 * even.step_time_s
    assert result.seconds < 20  # ~1-3 s on one core; generous for a loaded test machine


def test_memory_caps_move_layers_to_the_devices_with_room():
    # H100s with 40 GB beside A100s with 80 GB: by speed the H100 stages would take most layers, but they
    # cannot hold them, so the planner gives the roomier A100 stages more (Metis).
    cluster = parse_cluster("2x8xH100-SXM:mem=40GB+2x8xA100-80GB")
    result = search(PRESETS["llama3-70b"], cluster, TrainSpec(seq_len=4096, global_batch=64), top=1)
    best = result.candidates[0]
    assert best.estimate.fits and best.plan.pp > 1
    by_speed = speed_balanced_layers(Layout.of_plan(best.plan), STACKS["modern"])
    h100_ranks = [r for r in range(best.plan.pp) if cluster.slots()[best.plan.placement[
        best.plan.rank_of(pp=r)]].group == 0]

    def layers_on(split):
        return sum(split[s] for r in h100_ranks for s in best.plan.stages_of(r))
    assert layers_on(best.plan.layers_per_stage) < layers_on(by_speed)
    assert not estimate(dataclasses.replace(best.plan, layers_per_stage=by_speed)).fits


def test_plan_command_prints_the_placement(capsys, tmp_path):
    path = tmp_path / "mixed.toml"
    path.write_text(MIXED_TOML)
    assert main(["plan", "--model", "llama3-8b", "--cluster", str(path), "--seq-len", "4096",
                 "--global-batch", "32", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "#1 placement: " in out and "work split" in out and "#1 balance: " in out
