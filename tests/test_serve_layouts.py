"""Every serving layout on worker processes (gloo): tp2, pp2 (two steps in flight), tp2 x pp2, two replicas behind
the router, and a Qwen3-MoE with its experts split over tp2 x ep2. In each, greedy tokens equal transformers'
generate and seeded sampling gives the tokens of the single-process run. One launch per layout."""

from __future__ import annotations

import pytest

from fivefold.serve.engine import Engine, Request
from fivefold.serve.executor import LocalExecutor, make_executor
from fivefold.serve.sampling import SamplingParams
from fivefold.serve.source import open_source
from fivefold.spec.serve import BatchLimits, ServeLayout
from serve_models import hf_greedy, prompts, save_model

pytest.importorskip("transformers")
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.slow]

MAX_TOKENS = 8
LIMITS = BatchLimits(max_batch=16, max_tokens_per_step=64, kv_blocks=64, block_size=4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("layouts")
    return {family: save_model(folder / family, family) for family in ("llama", "qwen3_moe")}


def requests(prompt_ids):
    """The first half greedy, the second half sampled with a seed."""
    half = len(prompt_ids) // 2
    return [Request(str(i), ids, MAX_TOKENS, SamplingParams() if i < half else
                    SamplingParams(temperature=0.8, top_p=0.95, seed=11, key=i)) for i, ids in enumerate(prompt_ids)]


def run(executor, layout, source, prompt_ids):
    engine = Engine(executor, layout, source.eos_ids, source.spec.max_seq_len)
    batch = requests(prompt_ids)
    try:
        for request in batch:
            engine.add(request)
        while engine.busy:
            engine.step()
    finally:
        executor.close()
    return [r.output_ids for r in batch], engine


@pytest.mark.parametrize("family, degrees", [
    ("llama", dict(tp=2)),
    ("llama", dict(pp=2)),
    ("llama", dict(tp=2, pp=2)),
    ("llama", dict(replicas=2)),
    ("qwen3_moe", dict(tp=2, ep=2)),
], ids=["tp2", "pp2", "tp2xpp2", "replicas2", "moe-tp2-ep2"])
def test_layout_matches_transformers_and_the_single_process_run(models, family, degrees):
    model, folder = models[family]
    source = open_source(str(folder), None)
    prompt_ids = prompts(8, seed=5, shortest=3, longest=24)
    layout = ServeLayout(**degrees, dtype="fp32", kv_dtype="fp32", limits=LIMITS)
    layout.check_model(source.spec)
    single = ServeLayout(dtype="fp32", kv_dtype="fp32", limits=LIMITS)
    expected, _ = run(LocalExecutor(source, single), single, source, prompt_ids)
    tokens, engine = run(make_executor(source, layout), layout, source, prompt_ids)
    half = len(prompt_ids) // 2
    for ids, got in zip(prompt_ids[:half], tokens[:half]):
        assert got == hf_greedy(model, ids, MAX_TOKENS)
    assert tokens == expected  # greedy and sampled alike
    assert engine.most_in_flight == layout.pp  # pp2: two groups of requests in flight at once
    if layout.replicas > 1:
        assert engine.schedulers[1].steps > 0  # the router used the second replica
