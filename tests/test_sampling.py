"""The batched sampler (serve/sampling.py): greedy rows, the seeded hash draws, top-k / top-p masks, a row's token
independent of the batch it shares, and the distribution it draws from. Single process, milliseconds."""

from __future__ import annotations

import math

import torch

from fivefold.serve.sampling import GREEDY_BELOW, SamplingParams, sample_rows, uniform_draws


def test_greedy_rows_take_the_argmax_and_tiny_temperatures_are_greedy() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(), SamplingParams(temperature=1e-320), SamplingParams(temperature=GREEDY_BELOW / 2),
              SamplingParams(temperature=0.0, top_p=0.5), SamplingParams(temperature=0.0, top_k=3)]
    tokens = sample_rows(logits, params, [0] * 5).token_ids
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_uniform_draws_are_fixed_by_seed_key_and_position_and_spread_over_0_1() -> None:
    n = 20000
    seeds = torch.full((n,), 7, dtype=torch.long)
    keys = torch.arange(n, dtype=torch.long) % 97
    positions = torch.arange(n, dtype=torch.long) // 97
    u = uniform_draws(seeds, keys, positions)
    assert u.dtype == torch.float64 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert torch.equal(u, uniform_draws(seeds, keys, positions))
    # 10 equal bins hold ~n/10 each (chi-square with 9 degrees of freedom, p ~ 1e-6 at 50)
    counts = torch.bincount((u * 10).long(), minlength=10).double()
    assert float(((counts - n / 10) ** 2 / (n / 10)).sum()) < 50
    # neighbouring inputs give unrelated draws: another seed, key or position changes almost every number
    assert float((uniform_draws(seeds + 1, keys, positions) == u).double().mean()) < 1e-3
    assert float((uniform_draws(seeds, keys, positions + 1) == u).double().mean()) < 1e-3
    big = uniform_draws(torch.tensor([2**40 + 3]), torch.tensor([2**33 + 5]), torch.tensor([10**9]))
    assert 0.0 <= float(big) < 1.0


def test_a_rows_token_does_not_depend_on_its_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 40, generator=gen) * 2
    params = [SamplingParams(temperature=0.9, top_p=0.8, seed=3, key=i) for i in range(6)]
    params[2] = SamplingParams()  # greedy between sampled rows
    params[4] = SamplingParams(temperature=1.3, top_k=5, seed=3, key=4)
    positions = [11, 12, 13, 14, 15, 16]
    together = sample_rows(logits, params, positions).token_ids.tolist()
    alone = [sample_rows(logits[i:i + 1], [params[i]], [positions[i]]).token_ids.item() for i in range(6)]
    reversed_rows = sample_rows(logits.flip(0), params[::-1], positions[::-1]).token_ids.tolist()[::-1]
    assert together == alone == reversed_rows


def test_top_k_and_top_p_keep_only_the_most_likely_tokens() -> None:
    vocab = 30
    logits = torch.linspace(3.0, -3.0, vocab)[None].repeat(400, 1)  # token 0 most likely, then 1, 2, ...
    probs = torch.softmax(logits[0].double(), -1)
    top_k = sample_rows(logits, [SamplingParams(temperature=1.0, top_k=4, seed=1, key=i) for i in range(400)],
                        [0] * 400).token_ids
    assert set(top_k.tolist()) == {0, 1, 2, 3}
    nucleus = 0.5
    kept = int((torch.cumsum(probs, 0) - probs < nucleus).sum())  # tokens before the mass reaches 0.5, plus one
    top_p = sample_rows(logits, [SamplingParams(temperature=1.0, top_p=nucleus, seed=2, key=i) for i in range(400)],
                        [0] * 400).token_ids
    assert set(top_p.tolist()) == set(range(kept))
    one = sample_rows(logits[:3], [SamplingParams(temperature=1.0, top_p=1e-9, seed=5, key=i) for i in range(3)],
                      [0] * 3).token_ids
    assert one.tolist() == [0, 0, 0]  # the first token always stays


def test_draws_follow_the_softmax_at_the_temperature() -> None:
    vocab, n, temperature = 6, 6000, 0.7
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, -30.0]]).repeat(n, 1)
    params = [SamplingParams(temperature=temperature, seed=9, key=i) for i in range(n)]
    tokens = sample_rows(logits, params, [3] * n).token_ids
    expected = torch.softmax(logits[0].double() / temperature, -1) * n
    counts = torch.bincount(tokens, minlength=vocab).double()
    chi2 = float(((counts[:5] - expected[:5]) ** 2 / expected[:5]).sum())
    assert chi2 < 25  # 4 degrees of freedom: p ~ 5e-5 at 25
    assert counts[5] == 0  # a probability of ~1e-13 is not drawn in 6000 tries
    assert not math.isnan(chi2)


def test_extreme_logits_give_valid_tokens() -> None:
    logits = torch.tensor([[1e30, -1e30, 0.0, float("-inf")], [float("-inf"), 5.0, float("-inf"), float("-inf")]])
    tokens = sample_rows(logits, [SamplingParams(temperature=2.0, top_p=0.9, seed=0, key=0),
                                  SamplingParams(temperature=0.5, seed=0, key=1)], [0, 0]).token_ids
    assert tokens.tolist() == [0, 1]
