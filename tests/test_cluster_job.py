"""Training as a cluster job, what needs no worker process (the launch is recorded, not run: `launched`):
SIGTERM's decision to save, --resume auto, a metrics file of another run, --overwrite, a text field per data
source, --data-change allow, job-file paths relative to the file, a tokenizer that sizes the model's vocab,
tokenizer files through `convert`, and every new flag's bad values (one line, exit 2, nothing written)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from fivefold.checkpoint import checkpoint_problem, save_checkpoint, step_dir
from fivefold.cli import main
from fivefold.data import Blend, ByteTokenizer, GlobalBatchLoader, TokenDataset, open_data
from fivefold.errors import SpecError
from fivefold.models import build_model
from fivefold.runtime import RunConfig
from fivefold.runtime.bookkeeping import reduce_step_totals
from fivefold.runtime.preemption import TermWatch, should_save_on_term
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

RUN = ["train", "--nproc", "1", "--seq-len", "32", "--device", "cpu", "--json"]
DOCS = [f"Story {i}: the fox saw " + "a hill " * (i % 5 + 2) for i in range(40)]


def tokenizer_file(folder: Path, tokens: int) -> Path:
    """A word-level tokenizer.json of exactly `tokens` tokens (its last is <|endoftext|>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, tokens - 1)}, "<|endoftext|>": tokens - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def training_checkpoint(root: Path, step: int, data: str | None = None) -> Path:
    """A checkpoint as `fivefold train` writes it (tiny, seq 32, global batch 8, seed 0) at `step`."""
    spec = PRESETS["tiny"]
    model = build_model(spec)
    model.to_empty(device="cpu")
    loader = GlobalBatchLoader(open_data(data, ByteTokenizer()), 32, 8, seed=0)
    for _ in range(step):
        loader.next_batch()
    plan = Plan(model=spec, cluster=parse_cluster("1x1xcpu"), train=TrainSpec(seq_len=32, dtype="fp32"))
    return save_checkpoint({"model": model.state_dict()}, spec, step_dir(root, step), step=step, plan=plan,
                           extra={"train_state": {"step": step, "loader": loader.state_dict()}})


def write_rows(tmp_path: Path) -> tuple[Path, Path]:
    """The documents as JSONL rows with a `text` column and as Parquet rows with a `content` column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:25]))
    pq.write_table(pa.table({"content": DOCS[25:], "n": list(range(15))}), tmp_path / "b.parquet")
    return jsonl, tmp_path / "b.parquet"


# --- SIGTERM -------------------------------------------------------------------------------------

def test_sigterm_saves_again_only_when_the_newest_checkpoint_is_too_far_behind(monkeypatch):
    assert should_save_on_term(step=7, newest_step=5, unsaved_seconds=12.0, threshold=10.0)
    assert not should_save_on_term(7, 5, 8.0, 10.0)  # within --save-on-term-within: the recompute is cheap
    assert not should_save_on_term(7, 7, 99.0, 0.0)  # the save in flight was of this very step
    assert not should_save_on_term(7, 5, 99.0, None)  # --save-on-term-within off
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert RunConfig("").term_save_threshold() is None  # default: off outside Slurm
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert RunConfig("").term_save_threshold() == 0.0  # ... and on under Slurm
    assert RunConfig("", save_on_term_within="off").term_save_threshold() is None
    assert RunConfig("", save_on_term_within=30.0).term_save_threshold() == 30.0


def test_a_worker_notes_sigterm_and_every_rank_hears_of_it_in_the_steps_all_reduce():
    before = signal.getsignal(signal.SIGTERM)
    watch = TermWatch().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next line: noted, nobody dies
        assert watch.requested
    finally:
        watch.restore()
    assert signal.getsignal(signal.SIGTERM) is before
    plan = Plan(model=PRESETS["tiny"], cluster=parse_cluster("1x1xcpu"), train=TrainSpec(seq_len=32, dtype="fp32"))
    totals = reduce_step_totals(torch.tensor(4.0), torch.tensor(2.5), plan, 0, False, stop=True)
    assert (totals.grad_norm, totals.loss, totals.stop_requested) == (2.0, 2.5, True)
    assert not reduce_step_totals(torch.tensor(4.0), torch.tensor(2.5), plan, 0, False).stop_requested


# --- resume auto, another run's metrics, --overwrite ------------------------------------------------

def test_resume_auto_starts_fresh_then_continues_from_the_newest_checkpoint(tmp_path, launched):
    argv = [*RUN, "--steps", "4", "--checkpoint-dir", str(tmp_path / "ck"), "--resume", "auto",
            "--metrics-file", str(tmp_path / "run" / "metrics.jsonl")]
    assert main(argv) == 0 and launched[-1][0].resume_from is None  # nothing to resume: a fresh start
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")  # its first step
    training_checkpoint(tmp_path / "ck", 2)
    assert main(argv) == 0 and launched[-1][0].resume_from == str(step_dir(tmp_path / "ck", 2))
    assert launched[-1][0].resume == "auto" and "--resume auto" in " ".join(launched[-1][0].to_flags())


def test_a_metrics_file_of_another_run_is_refused_unless_resumed_or_overwritten(tmp_path, launched, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0}) + "\n" for s in (1, 2, 3, 4)))
    (run / "trace.jsonl").write_text("{}\n")
    (run / "events.jsonl").write_text(json.dumps({"kind": "launch", "time": 1.0, "restart": -1}) + "\n")
    argv = [*RUN, "--metrics-file", str(run / "metrics.jsonl")]
    assert main(argv) == 2 and not launched
    assert capsys.readouterr().err == (f"error: --metrics-file='{run / 'metrics.jsonl'}': holds steps 1-4 of another "
                                       "run; add --resume to continue it (with its --checkpoint-dir), --overwrite to "
                                       "replace it, or give a new file\n")
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4  # refused: untouched
    assert main([*argv, "--overwrite"]) == 0 and len(launched) == 1
    assert not (run / "metrics.jsonl").exists() and not (run / "trace.jsonl").exists()
    assert not (run / "events.jsonl").exists() and (run / "plan.toml").is_file()


# --- data ------------------------------------------------------------------------------------------

def test_each_source_of_a_blend_reads_its_own_text_field(tmp_path, launched):
    jsonl, parquet = write_rows(tmp_path)
    data = open_data(f"0.7:{jsonl}@text,0.3:{parquet}@content", ByteTokenizer())
    assert isinstance(data, Blend) and data.weights == pytest.approx([0.7, 0.3])
    assert [len(s) for s in data.sources] == [sum(len(d.encode()) + 1 for d in docs)  # + each document's end byte
                                              for docs in (DOCS[:25], DOCS[25:])]
    with pytest.raises(SpecError) as caught:  # the other source's field is not this one's
        open_data(f"0.7:{jsonl}@text,0.3:{parquet}@text", ByteTokenizer())
    assert str(caught.value) == f"--data='{parquet}@text': {parquet} has no such column; its columns: content, n"
    assert main([*RUN, "--data", f"0.7:{jsonl}@text,0.3:{parquet}@content", "--text-field", "body"]) == 0
    assert launched[-1][0].data == f"0.7:{jsonl}@text,0.3:{parquet}@content"
    (tmp_path / "story.txt").write_text(" ".join(DOCS))
    with pytest.raises(SpecError, match=r"only JSONL, Parquet and `datasets` rows have text fields; leave out @text"):
        open_data(f"{tmp_path / 'story.txt'}@text", ByteTokenizer())


def test_data_change_allow_keeps_the_position_of_each_source_read_before():
    a = TokenDataset(np.arange(0, 1000, dtype=np.int64) % 200, "a")  # 99 windows of seq 10
    b = TokenDataset(np.arange(0, 300, dtype=np.int64) % 200 + 50000, "b")  # 29 windows
    c = TokenDataset(np.arange(0, 500, dtype=np.int64) % 200 + 70000, "c")  # 49 windows
    before = GlobalBatchLoader(Blend([a, b], [0.7, 0.3]), seq_len=10, global_batch=8, seed=5)
    for _ in range(3):
        before.next_batch()
    state = json.loads(json.dumps(before.state_dict()))  # as fivefold.json carries it
    straight = [before.next_batch() for _ in range(2)]  # what `a` would have given next, unchanged
    after = GlobalBatchLoader(Blend([c, a], [0.5, 0.5]), seq_len=10, global_batch=8, seed=5)
    with pytest.raises(SpecError, match="loader state windows"):
        after.load_state_dict(state)
    after.load_state_dict(state, allow_change=True)
    assert (after.samples_seen, after.steps, after.source_samples) == (24, 3, [0, 17])  # a: 17 of 24 were its
    assert after.describe_change(state) == (
        "--data-change allow: the data differs from the checkpoint's; the run continues at sample 24 (step 3, the "
        "same schedule), with this blend's weights from here on; continuing where they were: a; starting at their "
        "beginning: c (new); no longer read: b")
    rows = torch.cat([after.next_batch() for _ in range(2)])
    from_a = [row for row in rows.tolist() if row[0] < 200]
    assert len(from_a) == 8 and len(rows) - len(from_a) == 8  # the new weights hold exactly from the resume on
    expected_a = [row for row in torch.cat(straight).tolist() if row[0] < 200]
    assert from_a == expected_a[:8]  # `a` goes on with the windows it would have given
    again = GlobalBatchLoader(Blend([c, a], [0.5, 0.5]), seq_len=10, global_batch=8, seed=5)
    again.load_state_dict(json.loads(json.dumps(after.state_dict())))  # a later resume without a change: exact
    assert torch.equal(again.next_batch(), after.next_batch())


def test_job_file_paths_are_read_from_its_folder_and_dumped_from_the_dump(tmp_path, launched, monkeypatch):
    jobs = tmp_path / "jobs"
    (jobs / "data").mkdir(parents=True)
    write_rows(jobs / "data")
    tok = tokenizer_file(jobs / "tok", 300)
    (jobs / "job.toml").write_text('[data]\ndata = "0.7:data/a.jsonl@text,0.3:data/b.parquet@content"\n'
                                   'tokenizer = "tok/tokenizer.json"\n[run]\nmetrics_file = "runs/a/metrics.jsonl"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main([*RUN, "--config", "../jobs/job.toml", "--dump-config", "dumped/job.toml"]) == 0
    config = launched[-1][0]
    assert config.data == "0.7:../jobs/data/a.jsonl@text,0.3:../jobs/data/b.parquet@content"
    assert (config.tokenizer, config.metrics_file) == (os.path.relpath(tok), "../jobs/runs/a/metrics.jsonl")
    import tomllib

    dumped = tomllib.loads((elsewhere / "dumped" / "job.toml").read_text())
    assert dumped["data"]["data"] == "0.7:../../jobs/data/a.jsonl@text,0.3:../../jobs/data/b.parquet@content"
    kept = tomllib.loads((jobs / "runs" / "a" / "job.toml").read_text())  # the run folder's copy, from there
    assert kept["data"]["data"] == "0.7:../../data/a.jsonl@text,0.3:../../data/b.parquet@content"
    assert kept["run"]["metrics_file"] == "metrics.jsonl"
    (jobs / "runs" / "a" / "metrics.jsonl").unlink(missing_ok=True)
    assert main([*RUN, "--config", "dumped/job.toml", "--overwrite"]) == 0  # the dump names the same files
    assert launched[-1][0].data == config.data and launched[-1][0].tokenizer == config.tokenizer


# --- tokenizers ----------------------------------------------------------------------------------

def test_the_tokenizer_sets_the_vocab_unless_the_model_fixes_it(tmp_path, launched, capsys):
    tok = str(tokenizer_file(tmp_path, 2000))
    assert main([*RUN, "--tokenizer", tok, "--json"]) == 0
    assert launched[-1][0].plan.model.vocab == 2048  # 2000 rounded up to a multiple of 128
    assert ("model vocab 256 -> 2048: the tokenizer's 2000 tokens rounded up to a multiple of 128 (give vocab in "
            "--model to fix it)") in capsys.readouterr().err
    assert main([*RUN, "--model", "preset=tiny,vocab=512", "--tokenizer", tok]) == 2
    assert capsys.readouterr().err == (f"error: --tokenizer='{tok}': has 2000 tokens but model.vocab=512, fixed by "
                                       "--model; give vocab=2048 (or more) in --model, or leave vocab out and the "
                                       "tokenizer sets it\n")
    plan = Plan(model=PRESETS["tiny"], cluster=parse_cluster("1x1xcpu"), train=TrainSpec(seq_len=32, dtype="fp32"))
    plan.save(tmp_path / "plan.toml")
    assert main(["train", "--plan", str(tmp_path / "plan.toml"), "--tokenizer", tok]) == 2
    assert capsys.readouterr().err == (f"error: --tokenizer='{tok}': has 2000 tokens but model.vocab=256, fixed by "
                                       f"the plan file {tmp_path / 'plan.toml'}; write vocab = 2048 in its [model] "
                                       "table, or leave out --plan and give the layout as flags\n")
    assert len(launched) == 1


def hf_folder(tmp_path: Path, vocab: int, tokens: int) -> Path:
    """A tiny Llama saved by transformers, with a tokenizer.json of `tokens` tokens beside it."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    tokenizer_file(tmp_path / "hf", tokens)
    return tmp_path / "hf"


def test_hf_folders_bring_their_tokenizer_to_training_and_through_convert(tmp_path, launched):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    hf = hf_folder(tmp_path, vocab=384, tokens=300)
    assert main([*RUN, "--init-from-hf", str(hf)]) == 0
    config = launched[-1][0]
    assert config.tokenizer == str(hf / "tokenizer.json") and config.plan.model.vocab == 384  # the model's own
    assert main(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "ck")]) == 0
    assert (tmp_path / "ck" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    assert checkpoint_problem(tmp_path / "ck") is None  # the tokenizer is in the manifest
    assert main(["convert", "--to-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "back")]) == 0
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    assert json.loads((tmp_path / "back" / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    text = "w1 w7 w299 w42 unknown"
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "back"))
    assert exported(text)["input_ids"] == Tokenizer.from_file(str(hf / "tokenizer.json")).encode(text).ids


# --- bad values ------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--save-on-term-within", "soon"], "--save-on-term-within='soon': give seconds of steps (a number from 0) or off"),
    (["--resume", "later"], "--resume='later': takes no value, or auto (resume when there is a checkpoint, else start "
                            "fresh)"),
    (["--overwrite", "--resume", "auto", "--checkpoint-dir", "ck"], "--overwrite=True: a resumed run continues its "
                                                                    "metrics file; leave out --overwrite, or --resume "
                                                                    "to start the run anew"),
    (["--data-change", "allow"], "--data-change='allow': only a resumed run can change its data; add --resume (or "
                                 "--resume auto)"),
    (["--data-change", "maybe"], "--data-change='maybe': use one of refuse, allow"),
    (["--profile-steps", "3-2", "--metrics-file", "r/metrics.jsonl"], "--profile-steps='3-2': must be A-B with 1 <= "
                                                                      "A <= B, e.g. 3-5"),
    (["--profile-steps", "2-30", "--metrics-file", "r/metrics.jsonl"], "--profile-steps='2-30': ends after the last "
                                                                       "step (10); profile steps within --steps"),
    (["--profile-steps", "2-3"], "--profile-steps='2-3': needs --metrics-file RUN/metrics.jsonl: the traces are "
                                 "written to RUN/profile/"),
    (["--profile-steps", "two", "--metrics-file", "r/metrics.jsonl"], "--profile-steps='two': give the first and "
                                                                      "last step profiled, e.g. 3-5 (or one step, "
                                                                      "e.g. 4)"),
    (["--wandb", "my project"], "--wandb='my project': a project name of letters, digits, '.', '_' and '-' "
                                "(ENTITY/PROJECT also works)"),
    (["--data", "0.7:story.txt@text,0.3:story.txt"], "--data='story.txt@text': only JSONL, Parquet and `datasets` "
                                                     "rows have text fields; leave out @text for this source"),
])
def test_bad_values_of_the_new_flags_are_one_line_and_write_nothing(tmp_path, capsys, launched, monkeypatch, flags,
                                                                     message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "story.txt").write_text(" ".join(DOCS))
    assert main([*RUN, *flags, "--dump-config", "job.toml"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: {message}\n" and not launched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["story.txt"]


def test_bad_values_in_a_job_file_name_the_file_and_key(tmp_path, capsys, launched):
    job = tmp_path / "job.toml"
    job.write_text('[run]\nsave_on_term_within = "soon"\n')
    assert main([*RUN, "--config", str(job)]) == 2
    assert capsys.readouterr().err == (f"error: {job}:[run].save_on_term_within='soon': give seconds of steps (a "
                                       "number from 0) or off\n")
    job.write_text('[run]\nsave_on_term_within = 30\nresume = "auto"\ncheckpoint_dir = "ck"\nterm_grace = 60\n'
                   '[data]\ndata_change = "allow"\n')
    assert main([*RUN, "--config", str(job)]) == 0
    config = launched[-1][0]
    assert (config.save_on_term_within, config.resume, config.term_grace, config.data_change) == (30.0, "auto", 60,
                                                                                                  "allow")
    job.write_text('[slurm]\ntime = "1:00:00"\n')
    assert main([*RUN, "--config", str(job)]) == 2  # sbatch's flags go with --slurm, from a file too
    assert capsys.readouterr().err.endswith("--time='1:00:00': is passed to sbatch: it goes with --slurm\n")


def test_wandb_goes_offline_without_a_key_or_a_server(tmp_path, monkeypatch):
    import socket

    from fivefold.local import free_port
    from fivefold.runtime.tracking import wandb_mode

    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    assert wandb_mode() == "offline"  # no API key: nothing could be uploaded
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    assert wandb_mode() == "offline"
    with socket.socket() as server:  # a server that answers (on this machine only)
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"  # the user's choice wins


def test_the_printed_torchrun_line_carries_max_restarts(tmp_path, launched, capsys):
    assert main([*RUN, "--max-restarts", "2", "--metrics-file", str(tmp_path / "run" / "metrics.jsonl")]) == 0
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("on several machines"))
    assert " --max-restarts 2 --rdzv-backend c10d " in line and launched.nprocs == [1]


CHILD = """
import importlib.util, os, signal, sys, time
spec = importlib.util.spec_from_file_location("preemption", sys.argv[1])  # the module alone: no torch to import
preemption = importlib.util.module_from_spec(spec)
spec.loader.exec_module(preemption)
marker = os.environ[preemption.TERM_MARKER_ENV]
for case in ("marked", "plain torchrun", "not marked"):
    if case == "plain torchrun":
        os.environ.pop(preemption.TERM_MARKER_ENV)
    if case == "not marked":
        os.environ[preemption.TERM_MARKER_ENV] = marker
        os.unlink(marker)
    watch = preemption.TermWatch().install()
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not watch.requested and time.monotonic() < deadline:
        time.sleep(0.02)  # a step in progress: the handler runs, the decision is the watching thread's
    print(case, "graceful" if watch.requested else "still running", flush=True)
    watch.restore()
"""


def test_only_a_sigterm_its_launcher_marked_stops_a_worker_gracefully(tmp_path):
    """A worker of fivefold's launchers stops gracefully when the launcher marked its SIGTERM (a preemption),
    and ends at once (exit 143) when nothing marked it (torch's agent stopping it after a peer failed); a worker
    of a plain torchrun (no marker) always stops gracefully."""
    import subprocess
    import sys

    from fivefold.runtime import preemption

    marker = tmp_path / "marker"
    marker.write_text("launcher\n")
    child = subprocess.run([sys.executable, "-c", CHILD, preemption.__file__], capture_output=True, text=True,
                           timeout=60, env={**os.environ, preemption.TERM_MARKER_ENV: str(marker)})
    assert child.stdout.splitlines() == ["marked graceful", "plain torchrun graceful"], child.stderr
    assert child.returncode == 128 + signal.SIGTERM  # "not marked": ended at once, never printed


def test_every_new_flag_goes_into_the_dumped_job_file_and_back(tmp_path, launched, capsys, monkeypatch):
    import tomllib

    monkeypatch.chdir(tmp_path)
    flags = ["--checkpoint-dir", "ck", "--resume", "auto", "--save-on-term-within", "30", "--term-grace", "60",
             "--data-change", "allow", "--wandb", "proj", "--profile-steps", "2-3", "--metrics-file",
             "run/metrics.jsonl", "--max-restarts", "1"]
    assert main([*RUN, *flags, "--dump-config", "job.toml"]) == 0
    job = tomllib.loads((tmp_path / "job.toml").read_text())
    expected = {"resume": "auto", "save_on_term_within": 30.0, "term_grace": 60, "data_change": "allow",
                "wandb": "proj", "profile_steps": "2-3", "overwrite": False, "max_restarts": 1}
    assert {key: (job["run"] | job["data"]).get(key) for key in expected} == expected
    first = launched[-1][0]
    (tmp_path / "run" / "metrics.jsonl").unlink(missing_ok=True)
    assert main([*RUN, "--config", "job.toml"]) == 0
    assert launched[-1][0] == first  # the same run, flag for flag
    slurm = ["--slurm", "--time", "1:00:00", "--partition", "p", "--account", "a", "--output", "o.log"]
    assert main([*RUN, *flags, *slurm, "--dump-config", "slurm.toml"]) == 0
    assert tomllib.loads((tmp_path / "slurm.toml").read_text())["slurm"] == {"time": "1:00:00", "partition": "p",
                                                                             "account": "a", "output": "o.log"}
    capsys.readouterr()
    assert main([*RUN, "--config", "slurm.toml", "--slurm"]) == 0  # the script again, from the file
    assert "#SBATCH --partition=p" in capsys.readouterr().out
