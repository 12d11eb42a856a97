"""Packed documents and the context-parallel cut, in one process: document ids and positions from the
end-of-document token, the loss of a packed row equals that of each document run on its own, the 2*cp
chunk cut, token files with document boundaries, and the one-line refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fivefold.cli import main
from fivefold.data import ByteTokenizer, default_dataset, load_tokenizer, open_dataset, read_token_file
from fivefold.data.prepare import main as prepare_main
from fivefold.models import build_model, init_weights
from fivefold.runtime.context_parallel import chunk_index, document_layout, shard_batch
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

EOD = 0


def test_document_layout_restarts_positions_after_each_end_token():
    row = torch.tensor([[5, 6, EOD, 7, 8, 9, EOD, EOD, 4]])
    positions, documents = document_layout(row, EOD)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0]]
    assert documents.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 3]]


def test_chunks_are_balanced_and_cover_the_sequence():
    cp, seq = 4, 32
    pieces = [chunk_index(seq, cp, r) for r in range(cp)]
    assert pieces[0].tolist() == [0, 1, 2, 3, 28, 29, 30, 31]  # chunks 0 and 7 of 8
    assert sorted(torch.cat(pieces).tolist()) == list(range(seq))
    # Causal work of a rank = sum over its queries of the keys they see (index + 1): equal on every rank.
    assert len({int((p + 1).sum()) for p in pieces}) == 1


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt"])
def test_packed_row_equals_each_document_on_its_own(preset):
    """Logits (and so the loss) of three documents packed in one row equal each document run alone,
    under RoPE (tiny) and learned positions (tiny-gpt): positions restart, attention stays inside."""
    torch.manual_seed(0)
    model = build_model(PRESETS[preset])
    model.to_empty(device="cpu")
    init_weights(model, 0)
    documents = [torch.randint(1, 256, (n,)) for n in (7, 12, 5)]
    documents = [torch.cat([d, torch.tensor([EOD])]) for d in documents]  # each closed by its end token
    packed = torch.cat(documents)[None, :]
    targets = torch.cat([packed[0, 1:], torch.tensor([42])])[None, :]  # next tokens of the packed stream
    plan = Plan(model=PRESETS[preset], cluster=parse_cluster("1x1xcpu"),
                train=TrainSpec(seq_len=packed.shape[1], global_batch=1, dtype="fp32", document_mask=True))
    inputs, _, extra = shard_batch(plan, 0, packed, targets, EOD)
    with torch.no_grad():
        packed_logits = model(inputs, **extra)
        alone = torch.cat([model(d[None, :]) for d in documents], dim=1)
        causal_only = model(packed)
    torch.testing.assert_close(packed_logits, alone, rtol=1e-5, atol=1e-5)
    packed_loss = F.cross_entropy(packed_logits[0], targets[0], reduction="sum")
    alone_loss = F.cross_entropy(alone[0], targets[0], reduction="sum")
    assert packed_loss.item() == pytest.approx(alone_loss.item(), rel=1e-6)
    # Without the mask the later documents see the earlier ones: a different loss.
    assert abs(F.cross_entropy(causal_only[0], targets[0], reduction="sum").item() - packed_loss.item()) > 1e-3


def test_shard_batch_cuts_tokens_targets_positions_and_documents_alike():
    plan = Plan(model=PRESETS["tiny"], cluster=parse_cluster("1x2xcpu"), cp=2,
                train=TrainSpec(seq_len=8, global_batch=1, dtype="fp32", document_mask=True))
    inputs = torch.tensor([[1, 2, EOD, 3, 4, 5, EOD, 6]])
    targets = inputs + 100
    tokens, labels, extra = shard_batch(plan, 1, inputs, targets, EOD)
    assert tokens.tolist() == [[EOD, 3, 4, 5]]  # chunks 1 and 2 of 4 (indices 2, 3 and 4, 5)
    assert labels.tolist() == [[100, 103, 104, 105]]
    assert extra["positions"].tolist() == [[2, 0, 1, 2]]
    assert extra["documents"].tolist() == [[0, 1, 1, 1]]


def test_builtin_and_prepared_token_files_carry_document_boundaries(tmp_path, capsys):
    data = default_dataset()
    ends = np.flatnonzero(np.asarray(data.tokens) == EOD)
    assert len(ends) == 4000 and ByteTokenizer().decode(list(data.tokens[:ends[0]])).startswith("Early the next")
    text = tmp_path / "docs.txt"
    text.write_text("first document\n\nsecond one\n\nthird\n")
    assert prepare_main([str(text), str(tmp_path / "docs.bin"), "--document-separator", "\\n\\n"]) == 0
    assert "3 end-of-document tokens" in capsys.readouterr().out
    prepared = read_token_file(tmp_path / "docs.bin")
    assert prepared.end_of_document == EOD
    assert bytes(prepared.tokens.astype(np.uint8)) == b"first document\x00second one\x00third\n\x00"
    # Without a separator, end-of-document bytes written in the text mark the boundaries.
    text.write_text("one\x00two\x00")
    assert open_dataset(str(text)).tokens.tolist().count(EOD) == 2


def hf_tokenizer_without_end_token(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE(unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.train_from_iterator(["some text to learn a few merges from"] * 10,
                           trainers.BpeTrainer(vocab_size=280, special_tokens=["[UNK]"],
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(folder / "tokenizer.json"))
    with_end = Tokenizer(models.BPE(unk_token="[UNK]"))
    with_end.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    with_end.train_from_iterator(["some text"] * 10, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["[UNK]", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (folder / "with_end").mkdir()
    with_end.save(str(folder / "with_end" / "tokenizer.json"))
    return folder / "tokenizer.json", folder / "with_end" / "tokenizer.json"


def test_hf_end_of_document_token_is_found_or_the_run_is_refused(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    without, with_end = hf_tokenizer_without_end_token(tmp_path)
    assert load_tokenizer(str(without)).end_of_document is None
    tok = load_tokenizer(str(with_end))
    assert tok.end_of_document == 1  # "<|endoftext|>", the second special token
    assert tok.encode("a<|endoftext|>b").count(1) == 1  # written in text, it is recognised
    assert main(["train", "--model", "layers=2,hidden=32,heads=2,vocab=512", "--cluster", "1x1xcpu", "--seq-len",
                 "16", "--steps", "1", "--device", "cpu", "--document-mask", "--tokenizer", str(without)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --document-mask=True: the tokenizer")
    assert "has no end-of-document token" in lines[0]


@pytest.mark.parametrize("flags, words", [
    (["--cp", "4", "--seq-len", "36"], "error: train.seq_len=36: must be divisible by 2*cp=8"),
    (["--cp", "4", "--cp-method", "ulysses"], "model.kv_heads=2 / tp=1 = 2 per tp rank is not divisible by cp=4"),
    (["--cp", "2", "--model", "tiny-gpt", "--seq-len", "512"],
     "longer than the learned position table (model.max_seq_len=256); context parallel (cp=2)"),
])
def test_bad_context_parallel_flags_are_one_line(capsys, flags, words):
    assert main(["train", "--cluster", "1x4xcpu", "--steps", "1", "--device", "cpu", *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], lines


def test_dryrun_builds_a_context_parallel_plan_with_the_training_cut(capsys):
    """`fivefold dryrun` feeds the runtime the same cp columns, positions and document ids as training."""
    assert main(["dryrun", "--model", "tiny", "--cluster", "1x2xcpu", "--cp", "2", "--cp-method", "ulysses",
                 "--seq-len", "32", "--document-mask"]) == 0
    assert "dp1 tp1 pp1 cp2-ulysses" in capsys.readouterr().out
