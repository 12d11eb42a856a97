"""fivefold.data: tokenizers, token files, the plan-independent global batch loader and its state."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fivefold.data import (ByteTokenizer, GlobalBatchLoader, TokenDataset, builtin_corpus, default_dataset,
                           load_tokenizer, open_dataset, read_token_file, write_token_file, write_tokens)
from fivefold.data.prepare import main as prepare_main
from fivefold.errors import SpecError


def counting_dataset(n: int = 1001) -> TokenDataset:
    return TokenDataset(np.arange(n, dtype=np.uint32) % 50000, "count")


def test_byte_tokenizer_round_trips_unicode():
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256
    assert tok.encode("Hi é") == [72, 105, 32, 195, 169]
    assert tok.decode(tok.encode("naïve — ok")) == "naïve — ok"


def test_hf_tokenizer_file(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE(unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = __import__("tokenizers").decoders.ByteLevel()
    hf.train_from_iterator([builtin_corpus()[:20000]], trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"],
                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(str(tmp_path))  # a folder holding tokenizer.json works too
    assert tok.vocab_size == 300
    ids = tok.encode("Mia walked to the market.")
    assert len(ids) < len("Mia walked to the market.")  # merges learned from the corpus
    assert tok.decode(ids) == "Mia walked to the market."
    # Text tokenized through a data file uses the same ids.
    (tmp_path / "t.txt").write_text("Mia walked to the market.")
    assert open_dataset(str(tmp_path / "t.txt"), tok).tokens.tolist() == ids


def test_missing_tokenizer_is_one_line(tmp_path):
    with pytest.raises(SpecError, match=r"--tokenizer=.*no such file"):
        load_tokenizer(str(tmp_path / "nope.json"))


def test_token_files_bin_and_npy_are_memory_mapped(tmp_path):
    tokens = np.array([1, 70000, 3, 4], dtype=np.int64)
    write_tokens(tokens, tmp_path / "big.bin")
    assert json.loads((tmp_path / "big.json").read_text())["dtype"] == "uint32"  # 70000 needs 32 bits
    big = read_token_file(tmp_path / "big.bin")
    assert isinstance(big.tokens, np.memmap) and big.tokens.tolist() == [1, 70000, 3, 4]
    small = open_dataset(str(write_tokens(np.array([5, 6, 7]), tmp_path / "small.bin")))
    assert small.tokens.dtype == np.uint16 and small.tokens.tolist() == [5, 6, 7]
    np.save(tmp_path / "arr.npy", np.array([9, 8, 7], dtype=np.int32))
    assert open_dataset(str(tmp_path / "arr.npy")).tokens.tolist() == [9, 8, 7]
    # A .bin without sidecar is uint16 (nanoGPT convention).
    np.array([300, 2], dtype=np.uint16).tofile(tmp_path / "raw.bin")
    assert read_token_file(tmp_path / "raw.bin").tokens.tolist() == [300, 2]


def test_bad_token_files_are_one_line(tmp_path):
    with pytest.raises(SpecError, match=r"--data=.*no such file"):
        open_dataset(str(tmp_path / "missing.bin"))
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(SpecError, match="not a whole number of uint16 tokens"):
        read_token_file(tmp_path / "odd.bin")
    (tmp_path / "bad.bin").write_bytes(b"\x00" * 8)
    (tmp_path / "bad.json").write_text('{"dtype": "float32"}')
    with pytest.raises(SpecError, match=r"bad.json:dtype='float32': use one of uint16, uint32"):
        read_token_file(tmp_path / "bad.bin")
    with pytest.raises(SpecError, match="needs at least 129"):
        GlobalBatchLoader(TokenDataset(np.arange(100), "short"), seq_len=128, global_batch=2, seed=0)


def test_text_file_is_tokenized_once_and_cached(tmp_path):
    text = tmp_path / "story.txt"
    text.write_text("abc" * 10)
    first = open_dataset(str(text))
    cache = tmp_path / "story.txt.byte.bin"
    assert cache.is_file() and first.tokens.tolist() == [97, 98, 99] * 10
    stamp = cache.stat().st_mtime_ns
    assert open_dataset(str(text)).tokens.tolist() == first.tokens.tolist()
    assert cache.stat().st_mtime_ns == stamp  # reused, not rewritten
    text.write_text("xyz")  # changed source -> re-tokenized
    assert open_dataset(str(text)).tokens.tolist() == [120, 121, 122]


def test_prepare_helper_writes_a_token_file(tmp_path, capsys):
    (tmp_path / "in.txt").write_text("hello world\n")
    assert prepare_main([str(tmp_path / "in.txt"), str(tmp_path / "out.bin")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert read_token_file(tmp_path / "out.bin").tokens.tolist() == list(b"hello world\n")
    assert prepare_main([str(tmp_path / "none.txt"), str(tmp_path / "x.bin")]) == 2
    assert write_token_file(tmp_path / "in.txt", tmp_path / "again.bin").name == "again.bin"


def test_builtin_corpus_is_deterministic_and_english_like():
    text = builtin_corpus()
    assert text == builtin_corpus.__wrapped__()  # regenerated from scratch: same text
    assert 1_000_000 < len(text.encode()) < 2_000_000
    assert text.startswith("Early the next day, Rosa walked to the forest.")
    data = default_dataset()
    # Packed documents: every story ends with a newline and the byte tokenizer's end-of-document byte 0.
    assert data.vocab_size == 256 and data.end_of_document == 0
    assert data.tokens.astype(np.uint8).tobytes() == text.encode().replace(b"\n\n", b"\n\x00") + b"\x00"
    assert int((data.tokens == 0).sum()) == 4000
    data.check_vocab(256)
    with pytest.raises(SpecError, match="model.vocab=128: the data builtin was tokenized with a vocabulary of 256"):
        data.check_vocab(128)


def test_batches_cover_windows_without_overlap_within_an_epoch():
    data = counting_dataset(1001)  # 1000 // 10 = 100 windows of 11 tokens
    loader = GlobalBatchLoader(data, seq_len=10, global_batch=20, seed=3)
    starts = []
    for _ in range(5):
        batch = loader.next_batch()
        assert batch.dtype == torch.int64 and batch.shape == (20, 11)
        assert torch.equal(batch[:, 1:] - batch[:, :-1], torch.ones(20, 10, dtype=torch.int64))
        starts += (batch[:, 0] // 10).tolist()
    assert sorted(starts) == list(range(100))  # one epoch = every window exactly once
    assert loader.epoch == 1
    second_epoch = loader.next_batch()[:, 0].tolist()
    assert second_epoch != [s * 10 for s in starts[:20]]  # a new permutation for epoch 1


def test_same_tokens_for_every_rank_and_seed_dependence():
    data = counting_dataset()
    a = GlobalBatchLoader(data, 10, 8, seed=1)
    b = GlobalBatchLoader(data, 10, 8, seed=1)
    c = GlobalBatchLoader(data, 10, 8, seed=2)
    batches = [a.next_batch() for _ in range(3)]
    assert all(torch.equal(x, b.next_batch()) for x in batches)
    assert not torch.equal(batches[0], c.next_batch())


def test_resume_at_step_3_gives_identical_batches():
    data = counting_dataset()
    reference = GlobalBatchLoader(data, 10, 6, seed=0)
    expected = [reference.next_batch() for _ in range(30)]  # crosses epochs (100 windows / 6 per step)
    first = GlobalBatchLoader(data, 10, 6, seed=0)
    for _ in range(3):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON round trip
    resumed = GlobalBatchLoader(data, 10, 6, seed=0)
    resumed.load_state_dict(state)
    for step in range(3, 30):
        assert torch.equal(resumed.next_batch(), expected[step]), step
    assert resumed.steps == 30


def test_restored_position_is_independent_of_dp():
    """Run with dp=2, save on one rank at step 3, resume with dp=4: the global tokens of each step match."""
    data = counting_dataset()
    single = GlobalBatchLoader(data, 10, 8, seed=5)
    expected = [single.next_batch() for _ in range(8)]

    def replica_rows(batch: torch.Tensor, dp: int, rank: int) -> torch.Tensor:
        per = batch.shape[0] // dp
        return batch[rank * per:(rank + 1) * per]

    old_ranks = [GlobalBatchLoader(data, 10, 8, seed=5) for _ in range(2)]
    for step in range(3):
        rows = [replica_rows(loader.next_batch(), 2, r) for r, loader in enumerate(old_ranks)]
        assert torch.equal(torch.cat(rows), expected[step])
    saved = old_ranks[1].state_dict()
    assert saved == old_ranks[0].state_dict()  # every rank holds the same position
    new_ranks = [GlobalBatchLoader(data, 10, 8, seed=5) for _ in range(4)]
    for loader in new_ranks:
        loader.load_state_dict(saved)
    for step in range(3, 8):
        rows = [replica_rows(loader.next_batch(), 4, r) for r, loader in enumerate(new_ranks)]
        assert torch.equal(torch.cat(rows), expected[step])


def test_state_from_other_data_or_seq_len_is_refused():
    loader = GlobalBatchLoader(counting_dataset(), 10, 4, seed=0)
    other = GlobalBatchLoader(counting_dataset(), 20, 4, seed=0)
    with pytest.raises(SpecError, match="loader state seq_len=20"):
        loader.load_state_dict(other.state_dict())


def test_tiny_model_learns_the_builtin_corpus():
    """A few dozen steps on the built-in corpus: the loss falls clearly from ln(256) = 5.55."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest, and immune to a busy machine
    try:
        losses = train_tiny_model(steps=40)
    finally:
        torch.set_num_threads(threads)
    assert losses[0] == pytest.approx(5.55, abs=0.1)
    assert sum(losses[-5:]) / 5 < 2.8, losses


def train_tiny_model(steps: int) -> list[float]:
    from fivefold.models import build_model, init_weights
    from fivefold.spec import ModelSpec

    torch.manual_seed(0)
    spec = ModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=256, max_seq_len=64)
    model = build_model(spec)
    model.to_empty(device="cpu")
    init_weights(model, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = GlobalBatchLoader(default_dataset(), seq_len=64, global_batch=8, seed=0)
    losses = []
    for _ in range(steps):
        batch = loader.next_batch()
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
