"""TrainSpec and Plan: derived fields, mesh coordinates, TOML round trip, and every validation path."""

import tomllib

import pytest

from fivefold.errors import SpecError
from fivefold.spec import PRESETS, Plan, TrainSpec, load_plan, parse_cluster, plan_from_dict
from fivefold.spec.plan import default_layers_per_stage


def make(cluster="1x8xH100", model="tiny", seq_len=128, global_batch=16, **fields):
    return Plan(model=PRESETS[model], cluster=parse_cluster(cluster),
                train=TrainSpec(seq_len=seq_len, global_batch=global_batch), **fields)


def test_train_spec_errors():
    assert TrainSpec(seq_len=4096, global_batch=512).tokens_per_step == 4096 * 512
    for kwargs, field in (({"seq_len": 0}, "train.seq_len"), ({"global_batch": -2}, "train.global_batch"),
                          ({"dtype": "int8"}, "train.dtype"), ({"optimizer": "sgd"}, "train.optimizer")):
        with pytest.raises(SpecError) as info:
            TrainSpec(**kwargs)
        assert info.value.field == field


def test_defaults_and_derived_fields():
    plan = make(dp=2, tp=2, pp=2, micro_batch=2)
    assert plan.world_size == 8 and plan.num_micro_batches == 4
    assert plan.layers_per_stage == (2, 2) and plan.placement == tuple(range(8))
    assert plan.describe() == "dp2 tp2 pp2 mb2x4 1f1b zero0 rc=none"


def test_uneven_layers_go_to_middle_stages():
    assert default_layers_per_stage(10, 4) == (2, 3, 3, 2)
    assert default_layers_per_stage(126, 16)[0] == 7 and default_layers_per_stage(126, 16)[-1] == 7
    assert sum(default_layers_per_stage(126, 16)) == 126
    assert default_layers_per_stage(5, 2) == (3, 2)


def test_mesh_coordinates_tp_innermost():
    plan = make(dp=2, tp=2, pp=2)
    assert plan.coords(0) == {"pp": 0, "dp": 0, "cp": 0, "tp": 0}
    assert plan.coords(5) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}
    assert all(plan.rank_of(**plan.coords(r)) == r for r in range(8))
    assert plan.group_ranks("tp", 5) == [4, 5]
    assert plan.group_ranks("dp", 5) == [5, 7]
    assert plan.group_ranks("pp", 5) == [1, 5]


def test_stage_owners_looped_and_v_shaped():
    model = "layers=8,hidden=64,heads=4,vocab=256"
    interleaved = Plan(model=__import__("fivefold.spec", fromlist=["parse_model"]).parse_model(model),
                       cluster=parse_cluster("1x4xcpu"), train=TrainSpec(global_batch=8), pp=4,
                       schedule="interleaved-1f1b", virtual_stages=2, micro_batch=2)
    assert [interleaved.stage_owner(s) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    zbv = interleaved.replace(schedule="zbv")
    assert [zbv.stage_owner(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert zbv.stages_of(0) == [0, 7]


def test_toml_round_trip(tmp_path):
    plan = make(cluster="2x8xA100-80GB+2x8xH100-SXM:nic=400Gb/s", dp=8, tp=2, pp=2, zero=1,
                recompute="selective", sequence_parallel=True, layers_per_stage=(3, 1),
                placement=tuple(reversed(range(32))))
    path = tmp_path / "plan.toml"
    plan.save(path)
    assert load_plan(path) == plan
    text = path.read_text()
    assert text.startswith("# fivefold plan: dp8 tp2 pp2")
    data = tomllib.loads(text)
    assert "vocab_parallel" not in data["plan"]  # the default is left out of the file
    vocab = make(dp=4, pp=2, vocab_parallel=True)
    vocab.save(path)
    assert load_plan(path) == vocab and vocab.describe().endswith(" vocab-parallel")
    data["plan"]["num_micro_batches"] = 99
    with pytest.raises(SpecError, match="plan.num_micro_batches"):
        plan_from_dict(data)


def test_uneven_replicas():
    plan = make(cluster="1x2xcpu", dp=2, global_batch=12, replica_micro_batches=(8, 4))
    assert plan.num_micro_batches == 8 and plan.micro_batches_of_replica(1) == 4
    with pytest.raises(SpecError, match="train.global_batch=12"):
        make(cluster="1x2xcpu", dp=2, global_batch=12, replica_micro_batches=(8, 5))


@pytest.mark.parametrize("fields, field, words", [
    ({"dp": 3}, "plan.dp*tp*pp*cp", "cluster's 8 devices"),
    ({"dp": 1, "tp": 8}, "plan.tp", "must divide model.heads=4"),
    ({"dp": 4, "tp": 2, "cp": 1, "pp": 1, "micro_batch": 3}, "plan.micro_batch", "must divide train.global_batch"),
    ({"dp": 2, "pp": 4, "layers_per_stage": (1, 1, 1, 2)}, "plan.layers_per_stage", "sums to 5"),
    ({"dp": 2, "pp": 4, "layers_per_stage": (2, 2)}, "plan.layers_per_stage", "one entry per stage"),
    ({"dp": 2, "pp": 4, "layers_per_stage": (1, 0, 2, 1)}, "plan.layers_per_stage", "stage 1 would hold nothing"),
    ({"dp": 2, "pp": 4, "layers_per_stage": (-1, 2, 2, 1)}, "plan.layers_per_stage", "cannot be negative"),
    ({"dp": 1, "pp": 8}, "plan.pp", "model has 4 layers"),
    ({"dp": 8, "zero": 4}, "plan.zero", "use 0, 1, 2 or 3"),
    ({"dp": 8, "recompute": "some"}, "plan.recompute", "none, selective, full"),
    ({"dp": 8, "schedule": "chimera"}, "plan.schedule", "gpipe"),
    ({"dp": 4, "pp": 2, "schedule": "interleaved-1f1b"}, "plan.virtual_stages", "2 or more"),
    ({"dp": 4, "pp": 2, "schedule": "zbv", "virtual_stages": 3}, "plan.virtual_stages", "exactly 2"),
    ({"dp": 4, "pp": 2, "virtual_stages": 2}, "plan.virtual_stages", "virtual stages need"),
    ({"dp": 8, "sequence_parallel": True}, "plan.sequence_parallel", "needs tp > 1"),
    ({"dp": 8, "vocab_parallel": True}, "plan.vocab_parallel", "needs pp > 1"),
    ({"dp": 4, "pp": 2, "vocab_parallel": "yes"}, "plan.vocab_parallel", "true or false"),
    ({"dp": 4, "cp": 2, "ep": 2}, "plan.ep", "needs an MoE model"),
    ({"dp": 8, "placement": (0, 0, 1, 2, 3, 4, 5, 6)}, "plan.placement", "exactly once"),
    ({"dp": 0, "tp": 8}, "plan.dp", "integer >= 1"),
    ({"dp": 8, "version": 7}, "plan.version", "reads plan version 1"),
    ({"dp": 2, "pp": 2, "cp": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2, "micro_batch": 8},
     "plan.micro_batch", "divisible by pp=2"),
])
def test_plan_errors(fields, field, words):
    with pytest.raises(SpecError) as info:
        make(**fields)
    assert info.value.field == field, str(info.value)
    assert words in str(info.value)


def test_context_parallel_and_learned_positions():
    with pytest.raises(SpecError, match="train.seq_len=100: must be divisible by 2\\*cp=16"):
        make(seq_len=100, dp=1, cp=8)
    with pytest.raises(SpecError, match="train.seq_len=104: must be divisible by 2\\*cp=16"):
        make(seq_len=104, dp=1, cp=8)  # 104 = 8 x 13: cp divides it, 2*cp does not
    assert make(seq_len=128, dp=1, cp=8).cp == 8
    with pytest.raises(SpecError, match="learned position table"):
        make(model="tiny-gpt", seq_len=512, dp=8)
    with pytest.raises(SpecError, match="max_seq_len=256.*context parallel \\(cp=2\\) does not lift that limit"):
        make(model="tiny-gpt", seq_len=512, dp=4, cp=2)


def test_ulysses_needs_heads_divisible_by_cp():
    # tiny: 4 heads, 2 kv heads. cp2 x tp1 splits 4 and 2 heads; cp4 cannot split 2 kv heads.
    four = "1x4xH100"
    assert make(four, dp=2, cp=2, cp_method="ulysses").describe().startswith("dp2 tp1 pp1 cp2-ulysses")
    with pytest.raises(SpecError, match="model.kv_heads=2 / tp=1 = 2 per tp rank is not divisible by cp=4"):
        make(four, dp=1, cp=4, cp_method="ulysses")
    with pytest.raises(SpecError, match="model.kv_heads=2 / tp=2 = 1 per tp rank is not divisible by cp=2"):
        make(four, dp=1, tp=2, cp=2, cp_method="ulysses")
    assert make(four, dp=1, tp=2, cp=2).cp_method == "allgather"  # all-gather has no head constraint
    with pytest.raises(SpecError, match="plan.cp_method='ring': use one of allgather, ulysses"):
        make(four, dp=2, cp=2, cp_method="ring")


def test_moe_expert_parallel():
    plan = make(model="mixtral-8x7b", cluster="2x8xH100", dp=4, tp=4, ep=4, global_batch=16)
    assert plan.ep == 4
    assert make(model="mixtral-8x7b", cluster="2x8xH100", dp=4, tp=4, ep=8, global_batch=16).ep == 8  # spans tp
    with pytest.raises(SpecError, match="--ep x --etp = 32 must divide tp\\*cp\\*dp=16"):
        make(model="mixtral-8x7b", cluster="2x8xH100", dp=4, tp=4, ep=8, etp=4, global_batch=16)


def test_load_plan_errors(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        load_plan(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[plan\n")
    with pytest.raises(SpecError, match="not valid TOML"):
        load_plan(bad)
    bad.write_text("[plan]\ndp = 1\n")
    with pytest.raises(SpecError, match=r"\[model\] table"):
        load_plan(bad)
    plan = make(dp=8)
    data = plan.to_dict()
    data["plan"]["speed"] = "fast"
    with pytest.raises(SpecError, match="plan.speed"):
        plan_from_dict(data)


def test_stages_may_hold_only_the_embedding_or_the_head():
    plan = make(dp=2, pp=4, layers_per_stage=(0, 2, 2, 0))
    assert plan.layers_per_stage == (0, 2, 2, 0)
    assert make(dp=4, pp=2, schedule="interleaved-1f1b", virtual_stages=2, layers_per_stage=(0, 2, 2, 0),
                global_batch=16, micro_batch=2).num_stages == 4
    with pytest.raises(SpecError, match="model has 4 layers; give --layers-per-stage with 0 for a stage holding only"):
        make(dp=1, pp=8)
    assert make("1x6xH100", dp=1, pp=6, layers_per_stage=(0, 1, 1, 1, 1, 0)).pp == 6  # 4 layers on 6 stages
