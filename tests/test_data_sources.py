"""--data forms (folder of shards, .txt, .jsonl, .parquet, `datasets` save_to_disk folders, folders of row
files), the token caches beside them (keyed by the source and the tokenizer, never written by a refused
command), weighted blends (exact proportions, deterministic, resumable from the loader state) and bad sources
(one line, exit 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fivefold.cli import main
from fivefold.data import (Blend, ByteTokenizer, GlobalBatchLoader, TokenDataset, open_data, parse_data_spec,
                           tokenize_documents, write_tokens)
from fivefold.data.documents import load_rows, tokenize_rows
from fivefold.errors import SpecError

DOCS = [f"Document {i}: " + "word " * (i % 7 + 3) for i in range(60)]
EXPECTED = tokenize_documents(DOCS, ByteTokenizer()).tolist()  # each document then byte 0


def write_jsonl(path: Path, docs=DOCS, field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "n": i}) + "\n" for i, d in enumerate(docs)))
    return path


def test_folder_of_shards_is_one_stream_in_name_order(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    write_tokens(np.arange(0, 70), shards / "part-000.bin", {"vocab_size": 256})  # + part-000.json sidecar
    np.save(shards / "part-001.npy", np.arange(70, 200, dtype=np.int32))
    write_tokens(np.arange(200, 256), shards / "part-002.bin")
    data = open_data(str(shards), ByteTokenizer())
    assert len(data) == 256 and data.vocab_size == 256
    assert data.tokens[0:256].tolist() == list(range(256))
    assert data.window(2, 32).tolist() == list(range(64, 97))  # a window across two shards
    data.check_ids(256)
    with pytest.raises(SpecError, match="holds token id 255 but model.vocab=200"):
        data.check_ids(200)


def save_forms(tmp_path: Path) -> dict[str, Path]:
    """The same documents as JSONL, Parquet, a `datasets` folder and a folder of JSONL files."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    forms = {"jsonl": write_jsonl(tmp_path / "docs.jsonl")}
    pq.write_table(pa.table({"text": DOCS, "n": list(range(len(DOCS)))}), tmp_path / "docs.parquet")
    forms["parquet"] = tmp_path / "docs.parquet"
    datasets.Dataset.from_dict({"body": DOCS}).save_to_disk(str(tmp_path / "saved"))
    forms["datasets"] = tmp_path / "saved"
    folder = tmp_path / "rows"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", DOCS[:25])
    write_jsonl(folder / "b.jsonl", DOCS[25:])
    forms["folder"] = folder
    return forms


def test_row_forms_tokenize_to_the_same_packed_documents_and_cache_beside_the_source(tmp_path):
    forms = save_forms(tmp_path)
    for kind, path in forms.items():
        field = "body" if kind == "datasets" else "text"
        data = open_data(str(path), ByteTokenizer(), text_field=field)
        assert data.tokens.tolist() == EXPECTED, kind
        cache = path.with_name(f"{path.name}.{field}.byte.bin")
        assert cache.is_file() and json.loads(cache.with_suffix(".json").read_text())["text_field"] == field
        stamp = cache.stat().st_mtime_ns
        assert open_data(str(path), ByteTokenizer(), text_field=field).tokens.tolist() == EXPECTED
        assert cache.stat().st_mtime_ns == stamp, kind  # reused, not tokenized again
    assert sorted(p.name for p in forms["datasets"].iterdir()) == ["data-00000-of-00001.arrow", "dataset_info.json",
                                                                  "state.json"]  # nothing written inside
    write_jsonl(forms["jsonl"], DOCS[:2])  # a changed source is tokenized again
    assert open_data(str(forms["jsonl"]), ByteTokenizer()).tokens.tolist() == tokenize_documents(
        DOCS[:2], ByteTokenizer()).tolist()


def test_text_file_folder_is_one_document_per_file(tmp_path):
    folder = tmp_path / "books"
    folder.mkdir()
    for i, doc in enumerate(DOCS[:3]):
        (folder / f"{i}.txt").write_text(doc)
    assert open_data(str(folder / "0.txt"), ByteTokenizer()).tokens.tolist() == list(DOCS[0].encode())
    assert (folder / "0.txt.byte.bin").is_file()  # a cache inside the folder is not one of its files
    assert open_data(str(folder), ByteTokenizer()).tokens.tolist() == tokenize_documents(DOCS[:3],
                                                                                          ByteTokenizer()).tolist()


def test_parallel_tokenizing_gives_the_same_tokens(tmp_path):
    rows = load_rows(write_jsonl(tmp_path / "docs.jsonl"), "json")
    one = tokenize_rows(rows, ByteTokenizer(), "text", "docs", num_proc=1)
    two = tokenize_rows(rows, ByteTokenizer(), "text", "docs", num_proc=2)
    assert one.tolist() == two.tolist() == EXPECTED


def test_blend_spec_parsing():
    assert parse_data_spec("web/") == [(1.0, "web/", None)]
    assert parse_data_spec("0.7:web/,0.3:code.jsonl") == [(0.7, "web/", None), (0.3, "code.jsonl", None)]
    assert parse_data_spec("0.7:a.jsonl@text,0.3:b.parquet@content") == [(0.7, "a.jsonl", "text"),
                                                                         (0.3, "b.parquet", "content")]
    assert parse_data_spec("b.parquet@content") == [(1.0, "b.parquet", "content")]
    assert parse_data_spec("data@2024/x.jsonl") == [(1.0, "data@2024/x.jsonl", None)]  # '@' inside a path
    for spec, why in [("0.7:web/,code.jsonl", "the blend item 'code.jsonl' has no weight"),
                      ("0:web/,1:code.jsonl", "the weight '0' of web/ must be a positive finite number"),
                      ("1e999:web/,1:b", "the weight '1e999' of web/ must be a positive finite number")]:
        with pytest.raises(SpecError, match=why):
            parse_data_spec(spec)


def blend(global_batch: int = 8) -> GlobalBatchLoader:
    a = TokenDataset(np.arange(0, 1000, dtype=np.int64) % 200, "a")  # 99 windows of seq 10
    b = TokenDataset(np.arange(0, 300, dtype=np.int64) % 200 + 50000, "b")  # 29 windows
    return GlobalBatchLoader(Blend([a, b], [0.7, 0.3]), seq_len=10, global_batch=global_batch, seed=5)


def test_blend_samples_by_weight_exactly_and_deterministically():
    loader = blend()
    batches = torch.cat([loader.next_batch() for _ in range(25)])  # 200 samples, b wraps past its 29 windows
    from_b = (batches[:, 0] >= 50000).tolist()
    assert sum(from_b) == 60 and loader.source_samples == [140, 60]
    for prefix in range(1, 201):  # every prefix within one sample of its share
        assert abs(sum(from_b[:prefix]) - 0.3 * prefix) <= 1
    again = blend()
    assert all(torch.equal(again.next_batch(), batches[8 * i:8 * i + 8]) for i in range(25))


def test_blend_resumes_from_its_state_with_the_same_tokens():
    straight = blend(8)
    expected = torch.cat([straight.next_batch() for _ in range(6)])
    first = blend(8)
    seen = torch.cat([first.next_batch() for _ in range(2)])
    state = json.loads(json.dumps(first.state_dict()))  # as fivefold.json carries it
    resumed = blend(4)  # another global batch: the position is counted in sequences
    resumed.load_state_dict(state)
    rest = torch.cat([resumed.next_batch() for _ in range(8)])
    assert torch.equal(torch.cat([seen, rest]), expected)
    other = GlobalBatchLoader(Blend(blend().sources, [0.5, 0.5]), 10, 8, seed=5)
    with pytest.raises(SpecError, match=r"loader state weights=\[0.7, 0.3\]"):
        other.load_state_dict(state)




def bad_sources(d: Path) -> list[tuple[str, str]]:
    write_jsonl(d / "docs.jsonl")
    write_jsonl(d / "other_field.jsonl", field="body")
    (d / "empty.jsonl").write_text("")
    (d / "table.csv").write_text("text\nhello\n")
    (d / "empty_dir").mkdir()
    (d / "mixed").mkdir()
    write_jsonl(d / "mixed" / "a.jsonl")
    write_tokens(np.arange(100), d / "mixed" / "b.bin")
    return [
        (f"{d}/nothing.jsonl", f"--data='{d}/nothing.jsonl': no such file or folder; give .bin/.npy tokens, .txt "
                               "text, .jsonl/.json/.parquet rows, a folder of one of these, or a `datasets` "
                               "save_to_disk folder"),
        (f"{d}/empty.jsonl", f"--data='{d}/empty.jsonl': is empty (no rows)"),
        (f"{d}/table.csv", f"--data='{d}/table.csv': unknown kind of file (.csv); give .bin/.npy tokens"),
        (f"{d}/other_field.jsonl", f"--text-field='text': {d}/other_field.jsonl has no such column; its columns: "
                                   "body, n"),
        (f"{d}/empty_dir", f"--data='{d}/empty_dir': the folder is empty; give a folder of .bin/.npy tokens"),
        (f"{d}/mixed", f"--data='{d}/mixed': the folder mixes json, shards files; give a folder of one kind"),
        (f"0.5:{d}/docs.jsonl,-1:{d}/docs.jsonl", f"--data='0.5:{d}/docs.jsonl,-1:{d}/docs.jsonl': the weight "
                                                  f"'-1' of {d}/docs.jsonl must be a positive finite number"),
    ]


def test_bad_sources_are_one_line_and_write_nothing(tmp_path, capsys, launched):
    for spec, message in bad_sources(tmp_path):
        before = sorted(p.name for p in tmp_path.rglob("*"))
        assert main(["train", "--nproc", "1", "--seq-len", "32", "--data", spec]) == 2, spec
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {message}") and "\n" not in err, err
        assert sorted(p.name for p in tmp_path.rglob("*")) == before and not launched


def test_a_refused_command_writes_no_token_cache(tmp_path, capsys, launched):
    data = write_jsonl(tmp_path / "docs.jsonl")
    argv = ["train", "--nproc", "1", "--seq-len", "32", "--data", str(data), "--json"]
    assert main([*argv, "--checkpoint-dir", str(tmp_path / "ck"), "--resume"]) == 2  # refused after the data
    assert "no complete checkpoint to resume from" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"] and not launched
    assert main(argv) == 0 and len(launched) == 1  # accepted: the cache is written before the launch
    assert (tmp_path / "docs.jsonl.text.byte.bin").is_file()


def train(tmp_path: Path, name: str, *argv: str) -> list[float]:
    import subprocess
    import sys

    metrics = tmp_path / name / "metrics.jsonl"
    result = subprocess.run([sys.executable, "-m", "fivefold", "train", "--seq-len", "32", "--global-batch", "4",
                             "--lr-schedule", "constant", "--warmup-steps", "0", "--device", "cpu",
                             "--metrics-file", str(metrics), "--json", *argv],
                            capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


@pytest.mark.slow
def test_a_blend_resumed_under_another_plan_trains_on_the_same_tokens(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):
        write_tokens(rng.integers(0, 256, 3000), shards / f"{i}.bin")
    data = f"0.7:{shards},0.3:{write_jsonl(tmp_path / 'docs.jsonl')}"
    ck = tmp_path / "ck"
    straight = train(tmp_path, "straight", "--nproc", "1", "--steps", "4", "--data", data, "--checkpoint-dir",
                     str(ck), "--checkpoint-every", "2")
    shutil.rmtree(ck / "step-00000004")  # continue from step 2, under dp2
    resumed = train(tmp_path, "resumed", "--nproc", "2", "--dp", "2", "--steps", "4", "--data", data,
                    "--checkpoint-dir", str(ck), "--resume")
    assert len(straight) == 4 and resumed == pytest.approx(straight[2:], rel=1e-5)


def test_resume_with_other_data_is_one_line_before_launch(tmp_path, capsys, launched):
    from fivefold.checkpoint import save_checkpoint, step_dir
    from fivefold.models import build_model
    from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

    a, b = write_jsonl(tmp_path / "a.jsonl"), write_jsonl(tmp_path / "b.jsonl", DOCS[:30])
    spec = PRESETS["tiny"]
    model = build_model(spec)
    model.to_empty(device="cpu")
    loader = GlobalBatchLoader(open_data(f"0.5:{a},0.5:{b}", ByteTokenizer()), 32, 8, seed=0)
    loader.next_batch()
    plan = Plan(model=spec, cluster=parse_cluster("1x1xcpu"), train=TrainSpec(seq_len=32, dtype="fp32"))
    save_checkpoint({"model": model.state_dict()}, spec, step_dir(tmp_path / "ck", 1), step=1, plan=plan,
                    extra={"train_state": {"step": 1, "loader": loader.state_dict()}})
    argv = ["train", "--nproc", "1", "--seq-len", "32", "--steps", "3", "--checkpoint-dir", str(tmp_path / "ck"),
            "--resume", "--json"]
    assert main([*argv, "--data", f"0.7:{a},0.3:{b}"]) == 2 and not launched
    assert capsys.readouterr().err.strip() == (f"error: --data='0.7:{a},0.3:{b}': the checkpoint's data had "
                                               "weights=[0.5, 0.5], this data has weights=[0.7, 0.3]; resume with "
                                               "the same data (and blend weights), or add --data-change allow")
    assert main([*argv, "--data", f"0.5:{a},0.5:{b}"]) == 0 and len(launched) == 1
    assert main([*argv, "--data", f"0.7:{a},0.3:{b}", "--data-change", "allow"]) == 0 and len(launched) == 2
    cache_a, cache_b = f"{a}.text.byte.bin", f"{b}.text.byte.bin"
    assert (
        f"--data-change allow: the data differs from the checkpoint's; the run continues at sample 8 (step 1, the "
        f"same schedule), with this blend's weights from here on; continuing where they were: {cache_a}, {cache_b}; "
        "starting at their beginning: none") in capsys.readouterr().err.splitlines()
    assert launched[-1][0].data_change == "allow"
