"""fivefold.checkpoint.layout: step folders, manifest + COMMIT, skipping bad ones, model save/load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fivefold.checkpoint import (CheckpointWarning, complete_checkpoints, load_model_state_dict, newest_checkpoint,
                                 prune_checkpoints, read_checkpoint_info, resolve_checkpoint, save_checkpoint,
                                 save_model_checkpoint, step_dir)
from fivefold.errors import SpecError
from fivefold.models import build_model, init_weights
from fivefold.spec import ModelSpec

SPEC = ModelSpec(name="t", layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, vocab=64, max_seq_len=32)


def model_with_seed(seed: int, spec: ModelSpec = SPEC):
    model = build_model(spec)
    model.to_empty(device="cpu")
    init_weights(model, seed)
    return model


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_save_writes_the_documented_layout(tmp_path):
    path = save_model_checkpoint(model_with_seed(0).state_dict(), SPEC, step_dir(tmp_path, 120), step=120)
    assert path.name == "step-00000120"
    names = set(snapshot(path))
    assert {".metadata", "fivefold.json", "manifest.json", "COMMIT"} <= names
    assert any(n.endswith(".distcp") for n in names)
    manifest = json.loads((path / "manifest.json").read_text())["files"]
    assert set(manifest) == names - {"manifest.json", "COMMIT"}
    import hashlib
    for name, entry in manifest.items():
        assert entry["sha256"] == hashlib.sha256((path / name).read_bytes()).hexdigest()
    info = read_checkpoint_info(path)
    assert info["step"] == 120 and info["model"] == SPEC and info["plan"] is None


def test_round_trip_restores_weights_exactly(tmp_path):
    source = model_with_seed(1)
    save_model_checkpoint(source.state_dict(), SPEC, step_dir(tmp_path, 5), step=5)
    target = model_with_seed(2)
    info = load_model_state_dict(tmp_path, target)  # a root: its newest checkpoint
    assert info["step"] == 5
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name


def test_incomplete_and_corrupted_are_skipped_with_a_warning_naming_them(tmp_path):
    state = model_with_seed(0).state_dict()
    good = save_model_checkpoint(state, SPEC, step_dir(tmp_path, 10), step=10)
    torn = save_model_checkpoint(state, SPEC, step_dir(tmp_path, 20), step=20)
    (torn / "COMMIT").unlink()  # the save died before committing
    bad = save_model_checkpoint(state, SPEC, step_dir(tmp_path, 30), step=30)
    shard = next(bad.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte: same size, wrong hash
    shard.write_bytes(bytes(data))
    short = save_model_checkpoint(state, SPEC, step_dir(tmp_path, 40), step=40)
    (short / "fivefold.json").write_text("{}")  # size differs from the manifest
    (tmp_path / "notes").mkdir()  # not a step folder: ignored silently

    with pytest.warns(CheckpointWarning) as caught:
        assert complete_checkpoints(tmp_path) == [good]
    messages = " | ".join(str(w.message) for w in caught)
    assert f"skipping checkpoint {torn}: incomplete" in messages
    assert f"skipping checkpoint {bad}: corrupted ({shard.name} does not match its SHA-256" in messages
    assert f"skipping checkpoint {short}: corrupted (fivefold.json has 2 bytes" in messages
    with pytest.warns(CheckpointWarning):
        assert newest_checkpoint(tmp_path) == good
    with pytest.raises(SpecError, match="corrupted"):
        resolve_checkpoint(bad)


def test_empty_root_has_no_checkpoint(tmp_path):
    assert complete_checkpoints(tmp_path / "none") == [] and newest_checkpoint(tmp_path) is None
    with pytest.raises(SpecError, match="no complete checkpoint here"):
        load_model_state_dict(tmp_path, model_with_seed(0))


def test_failed_load_leaves_the_directory_unchanged(tmp_path):
    path = save_model_checkpoint(model_with_seed(0).state_dict(), SPEC, tmp_path / "ck")
    before = snapshot(path)
    wider = ModelSpec(name="w", layers=2, hidden=48, heads=4, kv_heads=2, ffn_hidden=64, vocab=64, max_seq_len=32)
    target = model_with_seed(3, wider)
    untouched = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(SpecError, match=r"ck: model.tok_embeddings.weight=\[64, 32\]: the model expects shape "
                                        r"\[64, 48\]"):
        load_model_state_dict(path, target)
    deeper = ModelSpec(name="d", layers=3, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, vocab=64, max_seq_len=32)
    with pytest.raises(SpecError, match=r"model.layers.2.attention_norm.weight=None: missing from the checkpoint"):
        load_model_state_dict(path, model_with_seed(0, deeper))
    assert snapshot(path) == before
    assert all(torch.equal(v, untouched[k]) for k, v in target.state_dict().items())  # nothing half-loaded


def test_save_refuses_to_overwrite_and_cleans_a_torn_save(tmp_path):
    state = model_with_seed(0).state_dict()
    path = save_model_checkpoint(state, SPEC, tmp_path / "step-00000001", step=1)
    with pytest.raises(SpecError, match="already holds a complete checkpoint"):
        save_model_checkpoint(state, SPEC, path)
    (path / "COMMIT").unlink()
    (path / "__9_0.distcp").write_bytes(b"stale shard of a bigger world")
    save_model_checkpoint(state, SPEC, path, step=1)
    assert not (path / "__9_0.distcp").exists() and resolve_checkpoint(path) == path
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.txt").write_text("precious")
    with pytest.raises(SpecError, match="is not a checkpoint"):
        save_model_checkpoint(state, SPEC, tmp_path / "mine")
    assert (tmp_path / "mine" / "thesis.txt").read_text() == "precious"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_extra_state_and_pruning(tmp_path):
    model = model_with_seed(0)
    for step in (2, 4, 6):
        save_checkpoint({"model": model.state_dict(), "train_state": {"step": step, "loader": {"samples_seen": 8}}},
                        SPEC, step_dir(tmp_path, step), step=step, extra={"loss": 1.5})
    assert read_checkpoint_info(step_dir(tmp_path, 6))["extra"] == {"loss": 1.5}
    deleted = prune_checkpoints(tmp_path, keep=2)
    assert deleted == [step_dir(tmp_path, 2)] and not step_dir(tmp_path, 2).exists()
    assert complete_checkpoints(tmp_path) == [step_dir(tmp_path, 4), step_dir(tmp_path, 6)]
    import torch.distributed.checkpoint as dcp
    train_state = {"train_state": {"step": 0, "loader": {"samples_seen": 0}}}
    dcp.load(train_state, checkpoint_id=str(step_dir(tmp_path, 6)), no_dist=True)
    assert train_state["train_state"] == {"step": 6, "loader": {"samples_seen": 8}}
