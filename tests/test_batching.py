"""The serving scheduler (batching/): continuous batching, chunked prefill, paged KV blocks, preemption by
recompute, pipeline steps in flight, the router, and the serving layout's checks and KV arithmetic."""

import random

import pytest

from fivefold.batching import BlockPool, Scheduler, pick_replica
from fivefold.errors import SpecError
from fivefold.spec import PRESETS
from fivefold.spec.model import ModelSpec
from fivefold.spec.serve import BatchLimits, ServeLayout, kv_blocks_for_memory, kv_bytes_per_token


def run_to_end(scheduler, max_steps=10_000):
    """Drive the scheduler as a runtime would, one step at a time; returns {request: [(step, start, n), ...]}."""
    history: dict[str, list[tuple[int, int, int]]] = {}
    finished = []
    for _ in range(max_steps):
        if scheduler.idle:
            break
        step = scheduler.schedule()
        for rid, start, count in zip(step.request_ids, step.starts, step.num_tokens):
            history.setdefault(rid, []).append((step.number, start, count))
        finished += scheduler.update(step)
    assert scheduler.idle
    return history, finished


def test_block_pool_grows_and_releases():
    pool = BlockPool(4, 16)
    table: list[int] = []
    assert pool.grow(table, 17) and table == [0, 1]
    assert pool.grow(table, 32) and table == [0, 1]
    assert not pool.grow(table, 80) and table == [0, 1]  # 5 blocks needed, 4 exist: nothing taken
    assert pool.grow(table, 64) and pool.free == 0
    pool.release(table)
    assert table == [] and pool.free == 4 and pool.in_use == 0


def test_chunked_prefill_then_one_token_per_step():
    scheduler = Scheduler(BatchLimits(max_batch=8, max_tokens_per_step=10, kv_blocks=64, block_size=4))
    scheduler.add("a", prompt_tokens=25, max_new_tokens=3)
    history, finished = run_to_end(scheduler)
    # 25 prompt tokens in chunks of 10, 10, 5 (the last chunk samples the first token), then 2 decodes.
    assert [(start, n) for _, start, n in history["a"]] == [(0, 10), (10, 10), (20, 5), (25, 1), (26, 1)]
    assert finished == ["a"]
    assert scheduler.pool.free == 64


def test_decodes_first_then_new_prefills_under_the_budget():
    scheduler = Scheduler(BatchLimits(max_batch=8, max_tokens_per_step=8, kv_blocks=64, block_size=4))
    scheduler.add("a", 3, 5)
    first = scheduler.schedule()
    assert first.request_ids == ["a"] and first.num_tokens == [3] and first.samples == [True]
    scheduler.update(first)
    scheduler.add("b", 20, 2)
    second = scheduler.schedule()
    # a decodes (1 token), b takes the rest of the budget as a prefill chunk that samples nothing yet.
    assert list(zip(second.request_ids, second.starts, second.num_tokens, second.samples)) == [
        ("a", 3, 1, True), ("b", 0, 7, False)]


def test_max_batch_bounds_running_requests():
    scheduler = Scheduler(BatchLimits(max_batch=2, max_tokens_per_step=100, kv_blocks=64, block_size=4))
    for rid in "abc":
        scheduler.add(rid, 4, 2)
    step = scheduler.schedule()
    assert step.request_ids == ["a", "b"] and len(scheduler.waiting) == 1


def test_preemption_by_recompute_frees_blocks_and_requeues_at_the_head():
    # 6 blocks of 4 tokens = 24 tokens. a and b take 12 tokens each; the next decode needs a new block.
    scheduler = Scheduler(BatchLimits(max_batch=8, max_tokens_per_step=100, kv_blocks=6, block_size=4))
    scheduler.add("a", 12, 6)
    scheduler.add("b", 12, 6)
    first = scheduler.schedule()
    assert first.request_ids == ["a", "b"] and scheduler.pool.free == 0
    scheduler.update(first)
    second = scheduler.schedule()
    # a needs block 4 for its 13th token: b (admitted last) is preempted, a runs alone.
    assert second.preempted == ["b"] and second.request_ids == ["a"]
    assert scheduler.sequences["b"].computed == 0 and scheduler.waiting[0].request_id == "b"
    scheduler.update(second)
    history, finished = run_to_end(scheduler)
    assert sorted(finished) == ["a", "b"]
    # b recomputes its prompt and the token it had generated (13 tokens) before decoding on.
    assert history["b"][0][1:] == (0, 13)
    assert scheduler.preemptions == 1


def test_in_flight_requests_are_skipped_so_pipeline_steps_do_not_overlap():
    scheduler = Scheduler(BatchLimits(max_batch=8, max_tokens_per_step=4, kv_blocks=64, block_size=4))
    for rid in "abcd":
        scheduler.add(rid, 2, 3)
    first = scheduler.schedule()
    second = scheduler.schedule()  # the first is still in flight (pp 2)
    assert first.request_ids == ["a", "b"] and second.request_ids == ["c", "d"]
    assert len(scheduler.schedule()) == 0  # everyone is in flight
    scheduler.update(first)
    assert scheduler.schedule().request_ids == ["a", "b"]


def test_abort_frees_blocks_now_or_when_the_step_ends():
    scheduler = Scheduler(BatchLimits(max_batch=8, max_tokens_per_step=100, kv_blocks=16, block_size=4))
    scheduler.add("a", 8, 4)
    scheduler.add("b", 8, 4)
    step = scheduler.schedule()
    assert scheduler.abort("a")
    assert scheduler.pool.in_use == 4  # a's blocks wait for its step to end
    assert scheduler.update(step) == ["a"]
    assert scheduler.pool.in_use == 2 and "a" not in scheduler.sequences
    assert scheduler.abort("b") and scheduler.pool.in_use == 0 and scheduler.idle
    assert not scheduler.abort("nobody")


def test_stop_condition_from_the_runtime_finishes_early():
    scheduler = Scheduler(BatchLimits(max_batch=8, max_tokens_per_step=100, kv_blocks=16, block_size=4))
    scheduler.add("a", 4, 50)
    step = scheduler.schedule()
    assert scheduler.update(step, stopped={"a"}) == ["a"] and scheduler.idle


def test_requests_that_can_never_fit_are_refused_up_front():
    scheduler = Scheduler(BatchLimits(max_batch=8, max_tokens_per_step=100, kv_blocks=4, block_size=4))
    with pytest.raises(SpecError, match="max_tokens"):
        scheduler.add("a", 10, 7)
    with pytest.raises(SpecError, match="max_tokens"):
        scheduler.add("a", 10, 0)
    scheduler.add("a", 10, 6)
    with pytest.raises(SpecError, match="request_id"):
        scheduler.add("a", 1, 1)


def test_random_stream_keeps_every_invariant():
    rng = random.Random(0)
    limits = BatchLimits(max_batch=6, max_tokens_per_step=32, kv_blocks=20, block_size=4)
    scheduler = Scheduler(limits)
    produced: dict[str, int] = {}
    want = {}
    for number in range(5000):
        if number < 60 and rng.random() < 0.5:
            rid = f"r{number}"
            prompt, new = rng.randint(1, 40), rng.randint(1, 30)
            scheduler.add(rid, prompt, new)
            want[rid] = new
        if number >= 60 and scheduler.idle:
            break
        step = scheduler.schedule()
        assert step.total_tokens <= limits.max_tokens_per_step
        assert len(scheduler.running) <= limits.max_batch
        for rid, start, count, samples in zip(step.request_ids, step.starts, step.num_tokens, step.samples):
            seq = scheduler.sequences[rid]
            assert start == seq.computed and len(seq.table) * 4 >= start + count
            assert samples == (start + count == seq.num_tokens)
            # a recompute after preemption samples the token after those already generated, never one twice
            assert seq.output_tokens == produced.get(rid, 0)
            produced[rid] = produced.get(rid, 0) + samples
        blocks = sum(len(seq.table) for seq in scheduler.sequences.values())
        assert blocks == scheduler.pool.in_use
        assert scheduler.queued_tokens == sum(seq.queued_tokens for seq in scheduler.sequences.values())
        scheduler.update(step)
    assert scheduler.idle and produced == want
    assert scheduler.preemptions > 0  # the stream is tight enough to exercise preemption
    assert scheduler.pool.free == limits.kv_blocks and scheduler.queued_tokens == 0


def test_router_picks_the_replica_with_fewest_queued_tokens():
    replicas = [Scheduler(BatchLimits(kv_blocks=64)) for _ in range(3)]
    replicas[0].add("a", 100, 10)
    replicas[1].add("b", 5, 5)
    assert pick_replica(replicas) == 2
    replicas[2].add("c", 50, 50)
    assert pick_replica(replicas) == 1


def test_serve_layout_checks_name_the_flag():
    llama = PRESETS["llama3-8b"]
    ServeLayout(tp=8, pp=2).check_model(llama)
    with pytest.raises(SpecError, match="--tp"):
        ServeLayout(tp=3).check_model(llama)
    with pytest.raises(SpecError, match="--ep"):
        ServeLayout(tp=2, ep=2).check_model(llama)
    with pytest.raises(SpecError, match="--pp"):
        ServeLayout(pp=64).check_model(llama)
    with pytest.raises(SpecError, match="serve.max_batch"):
        BatchLimits(max_batch=0)
    with pytest.raises(SpecError, match="serve.kv_dtype"):
        ServeLayout(kv_dtype="int3")


def test_kv_bytes_per_token_and_blocks_for_memory():
    model = ModelSpec(layers=32, hidden=4096, heads=32, kv_heads=8, vocab=128256)
    # Llama 3 8B in bf16: 2 (K, V) x 32 layers x 8 kv heads x 128 x 2 bytes = 128 KiB per token.
    assert kv_bytes_per_token(model, tp=1, pp=1, kv_dtype="bf16") == 131072
    # tp 16 > 8 kv heads: each rank keeps one replicated head; pp 2: 16 layers on a stage.
    assert kv_bytes_per_token(model, tp=16, pp=2, kv_dtype="fp8") == 2 * 16 * 1 * 128 * 1
    assert kv_blocks_for_memory(2**30, model, 1, 1, "bf16", 16) == 2**30 // (131072 * 16)
    with pytest.raises(SpecError, match="--kv-memory"):
        kv_blocks_for_memory(1000, model, 1, 1, "bf16", 16)


def test_pipeline_depth_splits_the_requests_into_groups_in_flight_together():
    scheduler = Scheduler(BatchLimits(max_batch=8, max_tokens_per_step=100, kv_blocks=64, block_size=4), 2)
    for rid in "abcdef":
        scheduler.add(rid, 4, 3)
    first, second = scheduler.schedule(), scheduler.schedule()
    assert first.request_ids == ["a", "b", "c"] and second.request_ids == ["d", "e", "f"]
    assert len(scheduler.schedule()) == 0  # both groups in flight
    scheduler.update(first)
    assert scheduler.schedule().request_ids == ["a", "b", "c"]  # the first group decodes while the second runs
