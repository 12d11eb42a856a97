"""`fivefold train --checkpoint-dir/--resume/--init-from-hf` from the command line: a real run that saves,
prunes and resumes under another plan, and bad input that stops with one line before any worker starts,
leaving the checkpoint directory byte for byte as it was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import fivefold.runtime
from fivefold.checkpoint import (checkpoint_problem, read_checkpoint_info, save_checkpoint, save_model_checkpoint,
                                 step_dir)
from fivefold.cli import main
from fivefold.models import build_model, init_weights
from fivefold.spec import PRESETS, ModelSpec, Plan, TrainSpec, parse_cluster

RUN = ["train", "--cluster", "1x1xcpu", "--seq-len", "32", "--device", "cpu"]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def training_checkpoint(root: Path, step: int, spec: ModelSpec = PRESETS["tiny"], seed: int = 0) -> Path:
    """What `fivefold train` writes, as far as the pre-launch checks read it: weights in DCP, the plan and
    the run's train_state in fivefold.json (written here in one process, without a launch)."""
    model = build_model(spec)
    model.to_empty(device="cpu")
    init_weights(model, 0)
    plan = Plan(model=spec, cluster=parse_cluster("1x1xcpu"), train=TrainSpec(seq_len=32, dtype="fp32"))
    train_state = {"step": step, "lr_schedule": {"lr": 3e-3, "warmup_steps": 2, "steps": 10},
                   "loader": {"version": 1, "seed": seed, "seq_len": 32, "windows": 38612, "dataset": "builtin",
                              "samples_seen": 8 * step, "steps": step}}
    return save_checkpoint({"model": model.state_dict()}, spec, step_dir(root, step), step=step, plan=plan,
                           extra={"train_state": train_state})


@pytest.fixture
def launched(monkeypatch) -> list:
    """Record the configs `fivefold train` would launch, without starting a process."""
    calls: list = []

    def fake_launch(configs, nproc, max_restarts=0):
        calls.append(list(configs))
        return [{"fake": True}]

    monkeypatch.setattr(fivefold.runtime, "launch", fake_launch)
    return calls


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([*RUN, *argv])
    out, err = capsys.readouterr()
    return code, out, err


# --- bad input: one line, exit 2, nothing launched, directory unchanged ----------------------------

def corrupt_truncate(path: Path) -> str:
    shard = next(path.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    return f"corrupted ({shard.name} has {len(data) // 2} bytes, manifest says {len(data)})"


def corrupt_delete(path: Path) -> str:
    shard = next(path.glob("*.distcp"))
    shard.unlink()
    return f"corrupted ({shard.name} is missing)"


def corrupt_flip_byte(path: Path) -> str:
    shard = next(path.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return f"corrupted ({shard.name} does not match its SHA-256 in manifest.json)"


def corrupt_uncommitted(path: Path) -> str:
    (path / "COMMIT").unlink()
    return "incomplete (no COMMIT marker; the save did not finish)"


@pytest.mark.parametrize("corrupt", [corrupt_truncate, corrupt_delete, corrupt_flip_byte, corrupt_uncommitted])
def test_resume_from_a_damaged_checkpoint_stops_with_one_line(tmp_path, capsys, launched, corrupt):
    root = tmp_path / "ck"
    path = training_checkpoint(root, 3)
    problem = corrupt(path)
    before = snapshot(root)
    code, out, err = run_cli(capsys, "--steps", "6", "--checkpoint-dir", str(root), "--resume")
    assert code == 2 and not launched
    assert err.strip() == (f"error: --resume='{root}': no complete checkpoint to resume from; "
                           f"skipping checkpoint {path}: {problem}")
    assert snapshot(root) == before


def test_damaged_newest_is_skipped_with_a_warning_and_the_older_one_resumed(tmp_path, capsys, launched):
    root = tmp_path / "ck"
    older = training_checkpoint(root, 2)
    newest = training_checkpoint(root, 4)
    problem = corrupt_truncate(newest)
    before = snapshot(root)
    code, out, err = run_cli(capsys, "--steps", "6", "--checkpoint-dir", str(root), "--resume", "--json")
    assert code == 0
    # Moved aside, never deleted: the run would otherwise meet it again at step 4 (and prune around it).
    assert err.splitlines()[0] == (f"warning: checkpoint {newest} is {problem}: moved it aside to "
                                   f"step-00000004.corrupt (kept, not deleted); resuming from step-00000002")
    assert launched[0][0].resume_from == str(older)
    after = snapshot(root)
    assert after.pop("job.toml").startswith(b"# fivefold train --config FILE")  # the run folder keeps the job
    assert {name.replace("step-00000004.corrupt", "step-00000004"): data for name, data in after.items()} == before
    assert not newest.exists() and (root / "step-00000004.corrupt").is_dir()


def test_resume_with_another_model_names_the_field(tmp_path, capsys, launched):
    root = tmp_path / "ck"
    other = ModelSpec(name="other", layers=4, hidden=32, heads=4, kv_heads=2, ffn_hidden=128, vocab=256,
                      max_seq_len=256)
    path = training_checkpoint(root, 3, spec=other)
    before = snapshot(root)
    code, out, err = run_cli(capsys, "--steps", "6", "--checkpoint-dir", str(root), "--resume")
    assert code == 2 and not launched
    assert err.strip() == (f"error: {path}/fivefold.json:model.hidden=32: the checkpoint holds model other with "
                           "hidden=32, this run's model has hidden=64; resume with the same model, or use a new "
                           "--checkpoint-dir")
    assert snapshot(root) == before


def test_resume_checks_the_saved_tensor_shapes_too(tmp_path, capsys, launched):
    """fivefold.json says tiny, but the DCP files hold another shape (e.g. a hand-edited info file)."""
    root = tmp_path / "ck"
    other = ModelSpec(name="tiny", layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, vocab=256,
                      max_seq_len=256)
    path = training_checkpoint(root, 3, spec=other)
    info = json.loads((path / "fivefold.json").read_text())
    info["model"]["ffn_hidden"] = 128
    (path / "fivefold.json").write_text(json.dumps(info))
    from fivefold.checkpoint.layout import finalize_checkpoint  # re-seal, so only the shapes disagree

    (path / "COMMIT").unlink()
    finalize_checkpoint(path, PRESETS["tiny"], 3, extra=info["extra"])
    code, out, err = run_cli(capsys, "--steps", "6", "--checkpoint-dir", str(root), "--resume")
    assert code == 2 and not launched
    assert err.strip().startswith(f"error: {path}: model.layers.0.feed_forward.w1.weight=[96, 64]: "
                                  "the model expects shape [128, 64]")


@pytest.mark.parametrize("with_checkpoint, argv, message", [
    (False, ["--resume"], "error: --resume=True: needs --checkpoint-dir DIR (the folder of step-XXXXXXXX "
                          "checkpoints to continue from)"),
    (False, ["--checkpoint-every", "2"], "error: --checkpoint-every=2: needs --checkpoint-dir DIR"),
    (False, ["--checkpoint-dir", "{root}", "--keep", "0"], "error: --keep=0: must keep at least 1 checkpoint"),
    (False, ["--checkpoint-dir", "{root}", "--resume"],
     "error: --resume='{root}': no complete checkpoint to resume from (no step-XXXXXXXX folder)"),
    (True, ["--checkpoint-dir", "{root}", "--resume", "--seed", "5"],
     "error: --seed=5: the checkpoint's data order was drawn with seed 0; resume with --seed 0"),
    (True, ["--checkpoint-dir", "{root}", "--resume", "--seq-len", "16"],
     "error: --seq-len=16: the checkpoint was trained with seq_len 32; resume with --seq-len 32"),
    (True, ["--checkpoint-dir", "{root}", "--resume", "--steps", "3"],
     "error: --steps=3: the checkpoint is at step 3; give more steps than that to continue"),
    (True, ["--checkpoint-dir", "{root}"],
     "error: --checkpoint-dir='{root}': already holds checkpoints (newest step-00000003); add --resume to "
     "continue that run, or choose a new folder"),
])
def test_bad_checkpoint_flags_stop_with_one_line(tmp_path, capsys, launched, with_checkpoint, argv, message):
    root = tmp_path / "ck"
    if with_checkpoint:
        training_checkpoint(root, 3)
    root.mkdir(exist_ok=True)
    before = snapshot(root)
    argv = [a.replace("{root}", str(root)) for a in argv]
    code, out, err = run_cli(capsys, *(argv if "--steps" in argv else [*argv, "--steps", "6"]))
    assert code == 2 and not launched
    assert err.strip() == message.replace("{root}", str(root))
    assert snapshot(root) == before


def test_resume_from_a_weights_only_checkpoint_is_refused(tmp_path, capsys, launched):
    root = tmp_path / "ck"
    model = build_model(PRESETS["tiny"])
    model.to_empty(device="cpu")
    path = save_model_checkpoint(model.state_dict(), PRESETS["tiny"], step_dir(root, 0))
    code, out, err = run_cli(capsys, "--steps", "6", "--checkpoint-dir", str(root), "--resume")
    assert code == 2 and not launched
    assert err.strip() == (f"error: --resume='{path}': holds weights only (no optimizer or data position; e.g. "
                           "written by `fivefold convert`); resume needs a checkpoint written by `fivefold train`")


def test_init_from_hf_refuses_a_folder_that_is_not_llama(tmp_path, capsys, launched):
    folder = tmp_path / "hf"
    folder.mkdir()
    code, out, err = run_cli(capsys, "--steps", "2", "--init-from-hf", str(folder))
    assert code == 2 and err.strip() == f"error: --init-from-hf='{folder}': no config.json; give a local Hugging " \
                                        "Face Llama folder"
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    code, out, err = run_cli(capsys, "--steps", "2", "--init-from-hf", str(folder))
    assert code == 2 and not launched
    assert err.strip() == (f"error: {folder}/config.json:model_type='gpt2': only Llama checkpoints (model_type "
                           "llama, LlamaForCausalLM), mixtral and qwen3_moe can be imported")


def test_init_from_hf_takes_the_model_from_config_json(tmp_path, capsys, launched):
    from fivefold.checkpoint.hf import save_hf

    spec = ModelSpec(name="hf-small", layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, vocab=256,
                     max_seq_len=64)
    model = build_model(spec)
    model.to_empty(device="cpu")
    save_hf(spec, model.state_dict(), tmp_path / "hf")
    code, out, err = run_cli(capsys, "--steps", "2", "--init-from-hf", str(tmp_path / "hf"), "--json")
    assert code == 0, err
    config = launched[0][0]
    assert config.init_from_hf == str(tmp_path / "hf")
    assert config.plan.model.hidden == 32 and config.plan.model.layers == 2


# --- a real run: save every step, keep 2, resume under another plan and process count -------------

@pytest.mark.slow
def test_train_saves_prunes_and_resumes_under_another_plan(tmp_path, capfd):
    """Workers print on the inherited file descriptors, hence capfd."""
    root = tmp_path / "ck"
    two = ["train", "--cluster", "1x2xcpu", "--seq-len", "32", "--steps", "6", "--device", "cpu",
           "--checkpoint-dir", str(root)]
    code = main([*two, "--dp", "2", "--zero", "1", "--checkpoint-every", "2", "--keep", "2",
                 "--metrics-file", str(tmp_path / "first" / "metrics.jsonl")])
    out, err = capfd.readouterr()
    assert code == 0, err
    assert f"checkpoints in {root} (training waited" in out and "for 3 save(s))" in out
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004", "step-00000006"]  # --keep 2
    assert all(checkpoint_problem(p) is None for p in root.iterdir())
    first = [json.loads(line) for line in (tmp_path / "first" / "metrics.jsonl").read_text().splitlines()]

    # As if the run had died while writing step 6 (its folder has no COMMIT), and an older run had left
    # an unfinished step 5.
    (step_dir(root, 6) / "COMMIT").unlink()
    shutil.copytree(step_dir(root, 4), step_dir(root, 5), ignore=shutil.ignore_patterns("COMMIT"))
    code = main([*two, "--pp", "2", "--micro-batch", "2", "--resume",
                 "--metrics-file", str(tmp_path / "second" / "metrics.jsonl")])
    out, err = capfd.readouterr()
    assert code == 0, err
    assert err.splitlines()[:2] == [f"warning: skipping checkpoint {step_dir(root, step)}: incomplete (no COMMIT "
                                    "marker; the save did not finish)" for step in (6, 5)]
    assert (f"resumed from {step_dir(root, 4)} (step 4, saved under dp2 tp1 pp1 zero1); plan changed: dp 2 -> 1, "
            "pp 1 -> 2, zero 1 -> 0, micro_batch 1 -> 2, layers_per_stage [4] -> [2, 2]: weights and optimizer "
            "state resharded; data continues at sample 32") in out
    second = [json.loads(line) for line in (tmp_path / "second" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in second] == [5, 6]
    for before, after in zip(first[4:], second):
        assert after["loss"] == pytest.approx(before["loss"], rel=1e-5)
    # The unfinished step-6 folder was replaced by a complete one; the leftover step 5 is gone.
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004", "step-00000006"]
    assert checkpoint_problem(step_dir(root, 6)) is None
    assert read_checkpoint_info(step_dir(root, 6))["plan"]["plan"]["pp"] == 2
