"""MoE Parallel Folding in the plan: the etp x ep x edp regrouping of a stage's tp x cp x dp ranks (Megatron-Core's
order, etp innermost), its one-line refusals, the TOML round trip and the --etp flag."""

import pytest

from fivefold.cli import main
from fivefold.errors import SpecError
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster, plan_from_dict


def moe_plan(cluster="1x8xcpu", model="tiny-moe", **fields):
    return Plan(model=PRESETS[model], cluster=parse_cluster(cluster), train=TrainSpec(seq_len=32, global_batch=8),
                **fields)


def test_ep_spans_tp_and_dp_in_megatron_order():
    plan = moe_plan("1x4xcpu", tp=2, dp=2, ep=4)  # the ep group is the whole stage: both tp ranks of both replicas
    assert plan.edp == 1 and plan.expert_mesh_shape == (1, 1, 4, 1)
    assert plan.expert_group_ranks("ep", 3) == [0, 1, 2, 3]
    assert [plan.expert_coords(r)["ep"] for r in range(4)] == [0, 1, 2, 3]
    assert list(plan.experts_of_rank(2, 4)) == [2]
    folded = moe_plan("1x4xcpu", tp=2, dp=2, ep=2)  # ep over tp, edp over dp
    assert folded.expert_group_ranks("ep", 2) == [2, 3] and folded.expert_group_ranks("edp", 1) == [1, 3]


def test_etp_innermost_then_ep_then_edp_over_pipeline_stages():
    plan = moe_plan("1x8xcpu", pp=2, tp=2, dp=2, ep=2)  # per stage: 4 ranks = etp1 x ep2 x edp2
    assert plan.expert_group_ranks("ep", 5) == [4, 5] and plan.expert_group_ranks("edp", 5) == [5, 7]
    split = moe_plan("1x8xcpu", tp=2, dp=4, ep=2, etp=2)  # 8 ranks = etp2 x ep2 x edp2
    assert split.expert_coords(6) == {"pp": 0, "edp": 1, "ep": 1, "etp": 0}
    assert split.expert_group_ranks("etp", 6) == [6, 7]  # etp = the attention tp group here
    assert split.expert_group_ranks("ep", 6) == [4, 6]
    assert split.expert_group_ranks("edp", 6) == [2, 6]
    for rank in range(8):  # every rank is in exactly one group of each kind, and the numbering is a bijection
        assert split.expert_rank_of(**split.expert_coords(rank)) == rank
    cp = moe_plan("1x4xcpu", cp=2, dp=2, ep=2)  # ep over cp (cp is inner to dp in attention's order)
    assert cp.expert_group_ranks("ep", 0) == [0, 1] and [cp.coords(r)["cp"] for r in (0, 1)] == [0, 1]


@pytest.mark.parametrize("fields, words", [
    ({"dp": 8, "ep": 3}, "plan.ep=3: --ep must divide model.experts=4; valid: 1, 2, 4"),
    ({"dp": 2, "tp": 2, "cp": 2, "ep": 4, "etp": 4}, "plan.ep=4: --ep x --etp = 16 must divide tp*cp*dp=8"),
    ({"dp": 8, "etp": 3}, "plan.etp=3: --etp must divide the expert MLP width 64; valid: 1, 2, 4, 8"),
    ({"dp": 8, "etp": 2, "model": "tiny"}, "plan.etp=2: --etp: expert tensor parallelism needs an MoE model"),
    ({"dp": 8, "ep": 2, "model": "tiny"}, "plan.ep=2: --ep: expert parallelism needs an MoE model"),
])
def test_folding_refusals_are_one_line(fields, words):
    with pytest.raises(SpecError) as info:
        moe_plan(**fields)
    assert str(info.value).startswith(words) and "\n" not in str(info.value)


def test_etp_round_trips_through_toml_and_describe():
    import tomllib

    plan = moe_plan("1x8xcpu", tp=2, dp=4, ep=2, etp=2)
    assert plan.describe().startswith("dp4 tp2 pp1 ep2 etp2 ")
    again = plan_from_dict(tomllib.loads(plan.to_toml()))
    assert again == plan and again.etp == 2
    old = tomllib.loads(moe_plan("1x4xcpu", dp=4, ep=2).to_toml())
    del old["plan"]["etp"]  # a plan file written before etp existed reads as etp 1
    assert plan_from_dict(old).etp == 1


def test_etp_flag_reaches_estimate_and_is_checked(capsys):
    assert main(["estimate", "--model", "tiny-moe", "--cluster", "1x4xcpu", "--tp", "2", "--ep", "2", "--etp", "2",
                 "--seq-len", "32", "--json"]) == 0
    assert main(["estimate", "--model", "tiny-moe", "--cluster", "1x4xcpu", "--etp", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --etp=0: must be at least 1"
