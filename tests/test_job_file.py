"""`fivefold train --config job.toml`: sections checked key by key, command-line flags win, --dump-config writes
the effective job (and the run goes on), the run folder keeps it, and a run started from it trains the same."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fivefold.cli import main

JOB = """
[model]
model = "tiny"
[cluster]
nproc = 1
device = "cpu"
[layout]
micro_batch = 2
[data]
seq_len = 32
global_batch = 4
[optimizer]
lr = 2e-3
lr_schedule = "linear"
betas = "0.9,0.99"
[run]
steps = 7
seed = 3
"""




def test_the_job_file_sets_the_run_and_flags_win(tmp_path, launched):
    job = tmp_path / "job.toml"
    job.write_text(JOB)
    assert main(["train", "--config", str(job), "--json"]) == 0
    (config,), nproc = launched[-1], launched.nprocs[-1]
    plan = config.plan
    assert (nproc, plan.micro_batch, plan.train.seq_len, plan.train.global_batch) == (1, 2, 32, 4)
    assert (config.lr, config.lr_schedule, config.betas, config.steps, config.seed) == \
        (2e-3, "linear", "0.9,0.99", 7, 3)
    assert main(["train", "--config", str(job), "--steps", "9", "--lr", "1e-3", "--json"]) == 0
    (config,) = launched[-1]
    assert (config.steps, config.lr, config.lr_schedule) == (9, 1e-3, "linear")


@pytest.mark.parametrize("text, message", [
    ("[optimizer]\nlearning_rate = 1e-3\n", "[optimizer].learning_rate=0.001: unknown key in [optimizer]; it takes "
                                            "lr, warmup_steps, grad_clip, lr_schedule, min_lr, decay_steps, "
                                            "weight_decay, betas, eps"),
    ("[optimiser]\nlr = 1e-3\n", "section='optimiser': unknown section; a job file has model, cluster, layout, data, "
                                 "optimizer, run, slurm"),
    ("[run]\nlr = 1e-3\n", "[run].lr=0.001: belongs in the [optimizer] section"),
    ("[run]\nsteps = \"ten\"\n", "[run].steps='ten': --steps takes an integer"),
    ("[run]\nsteps = true\n", "[run].steps=True: --steps takes an integer"),
    ("[optimizer]\nlr = \"fast\"\n", "[optimizer].lr='fast': --lr takes a number"),
    ("[layout]\nschedule = \"2f2b\"\n", "[layout].schedule='2f2b': use one of gpipe, 1f1b, interleaved-1f1b, zb-h1, "
                                        "zbv"),
    ("[data]\ndocument_mask = 1\n", "[data].document_mask=1: --document-mask is a switch: write true or false"),
    ("lr = 1e-3\n", "lr=0.001: a key outside any section; put it in [optimizer]"),
    ("[run\n", "not valid TOML"),
])
def test_bad_job_files_are_one_line(tmp_path, capsys, launched, text, message):
    job = tmp_path / "job.toml"
    job.write_text(text)
    assert main(["train", "--config", str(job)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and not launched
    assert err.startswith(f"error: {job}:{message}") or (message == "not valid TOML" and message in err), err


def test_a_refused_run_writes_no_job_file(tmp_path, capsys, launched):
    assert main(["train", "--nproc", "1", "--lr", "-1", "--dump-config", str(tmp_path / "job.toml")]) == 2
    assert not (tmp_path / "job.toml").exists()
    assert main(["train", "--nproc", "1", "--dump-config", str(tmp_path)]) == 2
    assert "--dump-config" in capsys.readouterr().err


def losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


@pytest.mark.slow
def test_a_run_from_its_dumped_job_file_trains_the_same_losses(tmp_path):
    run = [sys.executable, "-m", "fivefold", "train"]
    first = subprocess.run([*run, "--nproc", "1", "--seq-len", "32", "--global-batch", "4", "--steps", "3",
                            "--lr-schedule", "wsd", "--weight-decay", "0.05", "--micro-batch", "2", "--device", "cpu",
                            "--metrics-file", str(tmp_path / "a" / "metrics.jsonl"),
                            "--dump-config", str(tmp_path / "job.toml")],
                           capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert f"wrote the job file {tmp_path / 'job.toml'}" in first.stdout
    job = tomllib.loads((tmp_path / "job.toml").read_text())
    assert job["optimizer"]["lr_schedule"] == "wsd" and job["layout"]["micro_batch"] == 2
    assert (tmp_path / "a" / "job.toml").read_text() == (tmp_path / "job.toml").read_text()  # the run folder's
    second = subprocess.run([*run, "--config", str(tmp_path / "job.toml"),
                             "--metrics-file", str(tmp_path / "b" / "metrics.jsonl")],
                            capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert losses(tmp_path / "b" / "metrics.jsonl") == losses(tmp_path / "a" / "metrics.jsonl")
    assert len(losses(tmp_path / "a" / "metrics.jsonl")) == 3
