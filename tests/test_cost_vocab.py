"""Zero-layer stages and vocabulary parallelism (issue 26) in the cost model, the simulator and the planner:
hand formulas for every named term (cost/vocab.py, cost/layout.py, cost/step.py)."""

import dataclasses
import json

import pytest

from fivefold.cli import main
from fivefold.cost import STACKS, estimate
from fivefold.cost.comm import SELF, all_reduce_time, topology_of
from fivefold.cost.dataparallel import tied_embedding_seconds
from fivefold.cost.layer import LayerShape, head_cost, padded_vocab
from fivefold.cost.layout import Layout, layer_costs, rank_envs, stage_params
from fivefold.cost.vocab import broadcast_time, pp_group_link, vocab_parallel_comm
from fivefold.errors import SpecError
from fivefold.planner import Choices, search
from fivefold.sim.engine import VOCAB_COLLECTIVES
from fivefold.sim.from_plan import simulate_plan
from fivefold.spec import PRESETS, ModelSpec, Plan, TrainSpec, parse_cluster

FIVEFOLD = STACKS["fivefold"]
GPT = ModelSpec(name="gpt-test", layers=8, hidden=1024, heads=16, mlp="gelu", norm="layernorm", position="learned",
                vocab=50257, max_seq_len=2048, tied_embeddings=True)


def _plan(model: ModelSpec = GPT, **fields: object) -> Plan:
    train = TrainSpec(seq_len=2048, global_batch=int(fields.pop("global_batch", 16)))
    return Plan(model=model, cluster=parse_cluster(str(fields.pop("cluster", "1x8xH100-SXM"))), train=train,
                **{"pp": 4, "dp": 2, "micro_batch": 1, **fields})


def _costs(plan: Plan):  # (LayerCosts of pipeline rank 0, Layout)
    layout = Layout.of_plan(plan)
    return layer_costs(layout, rank_envs(layout, topology_of(layout.cluster))[0], FIVEFOLD), layout


def test_zero_layer_stages_cost_the_embedding_alone_and_the_head_alone() -> None:
    plan = _plan(layers_per_stage=(0, 4, 4, 0))
    result, (costs, layout) = estimate(plan, FIVEFOLD), _costs(plan)
    first, middle, last = result.stage_costs[0], result.stage_costs[1], result.stage_costs[3]
    assert first.layers == 0 and last.layers == 0
    # compute: the embedding's passes alone, the head's (norm, GEMM, loss) alone; 4 layers in between
    assert first.forward == pytest.approx(costs.embedding.forward, rel=1e-12)
    assert last.forward == pytest.approx(costs.head.forward, rel=1e-12)
    assert last.backward_input == pytest.approx(costs.head.backward_input + costs.head.recompute, rel=1e-12)
    assert middle.forward == pytest.approx(4 * costs.layer.forward + costs.per_chunk.forward, rel=1e-12)
    # memory: the embedding stage keeps only the embedding output (bf16 h per token, and no dropout mask in
    # the fivefold stack's models); its parameters are the padded vocabulary rows and the learned positions
    assert first.activation_bytes == 2048 * 1024 * 2
    vocab_rows = padded_vocab(50257, 1) * 1024
    assert stage_params(layout, 0, True, False) == (vocab_rows + 2048 * 1024, 0.0)
    # the head stage: a tied head elsewhere needs its own copy of the rows, and the final LayerNorm
    assert stage_params(layout, 0, False, True) == (vocab_rows + 2 * 1024, 0.0)
    # pipeline position: the head alone is a quarter of a 4-layer stage here, so the middle ranks set the pace
    assert result.step_time_s < estimate(_plan(layers_per_stage=(2, 2, 2, 2)), FIVEFOLD).step_time_s


def test_vocab_parallel_collectives_by_hand() -> None:
    layout = Layout.of_plan(_plan(vocab_parallel=True))
    link = pp_group_link(layout, topology_of(layout.cluster))
    assert link.size == 4  # the pp ranks of one pipeline: ranks 0, 2, 4, 6 of the node
    tokens, hidden = 2048, 2048 * 1024 * 2  # one micro-batch of 2048 tokens; X is tokens x h in bf16
    comm = vocab_parallel_comm(layout, link, 2)
    ring = 2 * 3 * link.latency + 2 * 3 / 4 * hidden / link.ring_bandwidth  # 4-rank ring all-reduce of X
    tree = 2 * 2 * link.latency + 2 * hidden / link.ring_bandwidth
    assert comm.head_grad_all_reduce == pytest.approx(min(ring, tree), rel=1e-12)
    assert comm.embedding_all_reduce == comm.head_grad_all_reduce
    assert comm.head_input_broadcast == comm.embedding_grad_broadcast == pytest.approx(min(ring, tree) / 2)
    assert broadcast_time(hidden, link) == all_reduce_time(hidden, link) / 2
    assert comm.softmax_stats_all_reduce == all_reduce_time(tokens * 2 * 4, link)  # max and sum of exp, fp32
    assert comm.forward == comm.head_input_broadcast + comm.softmax_stats_all_reduce + comm.embedding_all_reduce
    assert comm.backward == comm.head_grad_all_reduce + comm.embedding_grad_broadcast


def test_vocab_parallel_splits_the_ends_over_every_rank() -> None:
    plan = _plan(vocab_parallel=True, layers_per_stage=(2, 2, 2, 2))
    result = estimate(plan, FIVEFOLD)
    costs, layout = _costs(plan)
    shape = LayerShape(GPT, 2048, 1, 1, 1, 1, False, "none", 1.0)
    env = rank_envs(layout, topology_of(layout.cluster))[0]
    comm = vocab_parallel_comm(layout, pp_group_link(layout, topology_of(layout.cluster)), 2)
    # each rank's head: its vocab/pp rows of the GEMM and the loss, plus the collectives
    assert costs.head.forward == pytest.approx(head_cost(shape, env.device, FIVEFOLD, env.tp, 4).forward
                                               + comm.forward, rel=1e-12)
    assert head_cost(shape, env.device, FIVEFOLD, env.tp, 4).forward < \
        head_cost(shape, env.device, FIVEFOLD, env.tp).forward / 2
    for stage in result.stage_costs:  # identical stages: 2 layers and both ends' slices on every rank
        assert stage.forward == pytest.approx(2 * costs.layer.forward + costs.per_chunk.forward
                                              + costs.embedding.forward + costs.head.forward, rel=1e-12)
    # memory: every rank holds its padded vocab / pp rows once (tied: embedding and head share them)
    rows = padded_vocab(50257, 4) * 1024 / 4
    assert stage_params(layout, 2, False, False) == pytest.approx((2 * GPT.params_per_layer() + rows, 0.0))
    untied = Layout.of_plan(_plan(model=dataclasses.replace(GPT, tied_embeddings=False), vocab_parallel=True))
    assert stage_params(untied, 2, False, False)[0] == pytest.approx(2 * GPT.params_per_layer() + 2 * rows)
    # ZeRO-3 gathers a layer's weights without the rows; a rank's other chunks do not hold them again
    assert stage_params(layout, 1, False, False, vocab_rows=False) == pytest.approx((GPT.params_per_layer(), 0.0))
    # no all-reduce of a tied embedding between the first and last stage: each rank's rows are both ends
    assert tied_embedding_seconds(layout, FIVEFOLD, topology_of(layout.cluster), 0, 6) == 0.0
    assert tied_embedding_seconds(Layout.of_plan(_plan()), FIVEFOLD, topology_of(layout.cluster), 0, 6) > 0
    # the breakdown names the collectives: m micro-batches x their seconds on the slowest rank
    assert result.breakdown_s["vocab_comm"] == pytest.approx(result.micro_batches * comm.total, rel=1e-12)
    assert "vocab_comm" not in estimate(_plan(), FIVEFOLD).breakdown_s


def test_vocab_parallel_evens_a_large_vocabulary_pipeline_and_the_simulator_replays_it() -> None:
    model = PRESETS["llama3-8b"]  # a 128k vocabulary: the head weighs half a 4-layer stage
    kwargs = dict(model=model, cluster="1x8xH100-SXM", pp=8, dp=1, global_batch=32)
    plain, split = (estimate(_plan(**kwargs, vocab_parallel=v), FIVEFOLD) for v in (False, True))
    work = [[s.forward + s.backward_input + s.backward_weight for s in e.stage_costs] for e in (plain, split)]
    assert work[0][-1] > 1.4 * work[0][1]  # the last stage carries the head alone without it
    assert max(work[1]) < 1.1 * min(work[1])  # within 10% of each other with it
    assert split.step_time_s < 0.85 * plain.step_time_s
    assert split.memory.total < plain.memory.total  # the last stage no longer holds 128k-wide logits alone
    simulated = simulate_plan(_plan(**kwargs, vocab_parallel=True))
    assert simulated.pipeline_time_s == pytest.approx(split.pipeline_s, rel=0.03)
    # drawn: one bar per forward and backward at the end of the pass, each the rank's collectives
    comm = vocab_parallel_comm(Layout.of_plan(_plan(**kwargs, vocab_parallel=True)), pp_group_link(
        Layout.of_plan(_plan(**kwargs)), topology_of(parse_cluster("1x8xH100-SXM"))), 2)
    bars = [e for e in simulated.events if e.kind == VOCAB_COLLECTIVES]
    assert len(bars) == 2 * 8 * 32 and all(e.lane == "cp" for e in bars)
    assert sorted({round(e.end - e.start, 12) for e in bars}) == sorted({round(comm.backward, 12),
                                                                         round(comm.forward, 12)})
    # interleaved: each rank's slices spread over its chunks; the replay still agrees with the walk
    chunks = _plan(**kwargs, vocab_parallel=True, schedule="interleaved-1f1b", virtual_stages=2)
    assert simulate_plan(chunks).pipeline_time_s == pytest.approx(estimate(chunks, FIVEFOLD).pipeline_s, rel=0.03)


def test_stacks_without_vocabulary_parallelism_say_so() -> None:
    plan = _plan(vocab_parallel=True)
    assert "the megatron-core stack cannot run this plan: vocabulary parallelism" in \
        estimate(plan, STACKS["megatron-core"]).notes
    assert not estimate(plan, FIVEFOLD).notes or "vocabulary" not in " ".join(estimate(plan, FIVEFOLD).notes)
    with pytest.raises(SpecError, match="--vocab-parallel=True: the megatron-core stack has no vocabulary"):
        search(GPT, parse_cluster("1x8xH100-SXM"), TrainSpec(seq_len=2048, global_batch=16),
               Choices(pp=4, vocab_parallel=True), stack=STACKS["megatron-core"])


def test_planner_proposes_vocab_parallel_when_the_head_dominates_and_says_why() -> None:
    model, cluster = PRESETS["llama3-8b"], parse_cluster("1x8xH100-SXM")
    train = TrainSpec(seq_len=4096, global_batch=64)
    found = search(model, cluster, train, Choices(pp=8, schedule="1f1b"), top=2, stack=FIVEFOLD)
    assert found.candidates[0].plan.vocab_parallel
    assert "vocabulary parallel: the LM head and loss make the last stage" in found.explanation
    assert "faster than without it" in found.explanation
    # a stack without it never proposes it
    core = search(model, cluster, train, Choices(pp=8, schedule="1f1b"), top=2, stack=STACKS["megatron-core"])
    assert not any(c.plan.vocab_parallel for c in core.candidates)
    # nor when the head is a small share of a stage: a 50k vocabulary at h 4096 costs about one layer
    # (V / 12h of a layer's GEMMs), under a quarter of 16 layers per stage
    wide = dataclasses.replace(GPT, layers=32, hidden=4096, heads=32)
    small = search(wide, cluster, TrainSpec(seq_len=2048, global_batch=16), Choices(pp=2), top=5, stack=FIVEFOLD)
    assert not any(c.plan.vocab_parallel for c in small.candidates)
    assert search(GPT, cluster, TrainSpec(seq_len=2048, global_batch=16), Choices(pp=2, vocab_parallel=True),
                  top=1, stack=FIVEFOLD).candidates[0].plan.vocab_parallel  # as fixed


def test_estimate_vocab_parallel_flag_shows_the_term(capsys) -> None:
    common = ["--model", "llama3-8b", "--cluster", "1x8xH100-SXM", "--seq-len", "4096", "--global-batch", "16",
              "--pp", "8"]
    assert main(["estimate", *common, "--vocab-parallel"]) == 0
    out = capsys.readouterr().out
    assert "vocab-parallel" in out and "vocabulary-parallel collectives (pp group)" in out
    assert main(["estimate", *common, "--vocab-parallel", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["breakdown_s"]["vocab_comm"] > 0
    assert main(["estimate", "--model", "llama3-8b", "--cluster", "1x8xH100-SXM", "--vocab-parallel"]) == 2
    assert "error: plan.vocab_parallel=True" in capsys.readouterr().err


def test_balanced_split_leaves_an_end_empty_when_its_extra_outweighs_a_layer() -> None:
    from fivefold.planner import balanced_layers

    # the head is 1.5 layers: alone on the last stage, its layer goes to the busiest-free middle
    assert balanced_layers(8, 8, 0.2, 1.5, empty_ends=True) == (1, 1, 1, 2, 1, 1, 1, 0)
    assert balanced_layers(8, 8, 0.2, 1.5) == (1,) * 8  # every stage keeps a layer otherwise
    assert balanced_layers(10, 4, 0.0, 2.0, empty_ends=True) == (3, 3, 3, 1)  # a layer still earns its place
    # on a rank with other stages the empty end is filled last (zbv-like: rank 0 holds both ends)
    assert balanced_layers(6, 4, 0.3, 1.2, owners=[0, 1, 1, 0], empty_ends=True) == (2, 2, 2, 0)


def test_planner_gives_the_head_its_own_stage_where_the_stack_can() -> None:
    model, cluster = PRESETS["llama3-8b"], parse_cluster("4x8xH100-SXM")
    train, fixed = TrainSpec(seq_len=4096, global_batch=32), Choices(pp=32, dp=1, tp=1, schedule="1f1b", micro_batch=1)
    core = STACKS["megatron-core"]
    found = search(model, cluster, train, fixed, top=1, stack=core)
    alone = found.candidates[0]
    assert alone.plan.layers_per_stage[-1] == 0 and not alone.plan.vocab_parallel  # the head alone: "..|L"
    assert "the LM head and loss alone on the last stage (" in found.explanation  # ... ms, N layers' worth)
    cannot = dataclasses.replace(core, features=dataclasses.replace(core.features, empty_end_stages=False))
    kept = search(model, cluster, train, fixed, top=1, stack=cannot).candidates[0]
    assert min(kept.plan.layers_per_stage) == 1  # a stack not known to run an empty stage: every stage keeps one
    assert alone.estimate.step_time_s < estimate(kept.plan, core).step_time_s


def test_explanations_read_a_breakdown_without_the_vocab_term() -> None:
    from fivefold.planner import Candidate
    from fivefold.planner.explain import explain_difference, explain_vocab_parallel

    plain, split = (_plan(vocab_parallel=v, layers_per_stage=(2, 2, 2, 2)) for v in (False, True))
    a, b = Candidate(plain, estimate(plain, FIVEFOLD)), Candidate(split, estimate(split, FIVEFOLD))
    text = explain_difference(a, b)  # the plan without it against one with it: no vocab_comm on one side
    assert text.startswith("vocabulary parallel=off instead of vocabulary parallel=on")
    assert "spends less on vocabulary-parallel collectives (" in text and "-> 0.00 ms per step" in text
    assert explain_vocab_parallel(b, a).startswith("vocabulary parallel: ")


def test_fivefold_stack_costs_the_runtimes_pp_only_split_under_tp() -> None:
    """fivefold's runtime gives every tp rank the whole vocab/pp slice on its own tokens (its sequence shard
    under sequence parallel, all of them without): exactly the head of one rank without tp on those tokens,
    with no tp collective; a stack that cuts the rows pp x tp ways (modern) gathers the normed sequence."""
    model = dataclasses.replace(PRESETS["llama3-8b"], vocab=131072)  # divisible by 128 x tp x pp: no padding
    plan = _plan(model=model, tp=2, pp=4, dp=1, vocab_parallel=True, sequence_parallel=True)
    layout = Layout.of_plan(plan)
    env = rank_envs(layout, topology_of(layout.cluster))[0]
    for sp, own_tokens in ((True, 1024), (False, 2048)):
        pp_only = head_cost(LayerShape(model, 2048, 1, 2, 1, 1, sp, "none", 1.0), env.device, FIVEFOLD, env.tp, 4)
        alone = head_cost(LayerShape(model, own_tokens, 1, 1, 1, 1, False, "none", 1.0), env.device, FIVEFOLD,
                          SELF, 4)
        assert pp_only == pytest.approx(alone, rel=1e-12) and pp_only.tp_comm == 0.0
    modern = head_cost(LayerShape(model, 2048, 1, 2, 1, 1, True, "none", 1.0), env.device, STACKS["modern"],
                       env.tp, 4)
    assert modern.tp_comm > 0.0
