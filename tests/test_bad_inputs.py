"""Every family of bad input, as a newcomer types it: exit code 2, exactly one line on stderr that names the
field, the value and the fix, no traceback, no worker started and nothing written anywhere (the folder of
bad files and the working directory are compared byte for byte before and after each case).

In-process calls of the CLI's main(), so ~100 cases take a few seconds; the signal tests (test_signals.py)
and the runs that must succeed (test_newcomer_runs.py) start real processes.
"""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path

import numpy as np
import pytest

import fivefold.profile.run
from fivefold.cli import main

# --- the bad files, made once --------------------------------------------------------------------------


class WritesAFileWhenUnpickled:
    """A .npy of these objects proves the data check never unpickles: loading one would create MARKER."""

    marker = ""

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _toml(folder: Path, name: str, text: str) -> None:
    (folder / name).write_text(text)


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bad")
    # model files
    _toml(d, "empty.toml", "")
    _toml(d, "model_string.toml", 'model = "tiny"\n')
    _toml(d, "model_dup.toml", "[model]\nlayers = 2\nlayers = 3\n")
    _toml(d, "model_bool.toml", "[model]\npreset = \"tiny\"\nlayers = true\n")
    _toml(d, "model_float.toml", "[model]\npreset = \"tiny\"\nlayers = 2.5\n")
    _toml(d, "model_nan.toml", "[model]\npreset = \"tiny\"\nrope_theta = nan\n")
    _toml(d, "model_huge.toml", "[model]\npreset = \"tiny\"\nheads = 1000000000000\n")
    _toml(d, "model_preset_list.toml", "[model]\npreset = [1]\n")
    _toml(d, "model_garbage.toml", "[model\nlayers =\n")
    # cluster files
    _toml(d, "cluster_list.toml", "[cluster]\ngroup = [1, 2]\n")
    _toml(d, "cluster_string.toml", 'cluster = "1x4xcpu"\n')
    _toml(d, "cluster_bool.toml", '[[group]]\nnodes = true\ndevice = "cpu"\n')
    _toml(d, "cluster_float.toml", '[[group]]\ngpus_per_node = 2.5\ndevice = "cpu"\n')
    _toml(d, "cluster_huge.toml", '[[group]]\nnodes = 100000000000\ngpus_per_node = 8\ndevice = "H100"\n')
    _toml(d, "cluster_nan_nic.toml", '[[group]]\nnodes = 2\ndevice = "H100"\nnic = nan\n')
    _toml(d, "cluster_negative_mem.toml", '[[group]]\ndevice = "H100"\nmem = -1\n')
    _toml(d, "cluster_inf_latency.toml", '[[group]]\ndevice = "H100"\nnvlink_latency = inf\n')
    _toml(d, "cluster_bool_tflops.toml", '[[group]]\ndevice = "H100"\npeak_tflops = { bf16 = true }\n')
    # plan files (a valid plan, then one field broken)
    from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

    good = Plan(model=PRESETS["tiny"], cluster=parse_cluster("1x2xcpu"), train=TrainSpec(seq_len=32), dp=2)
    text = good.to_toml()
    for name, old, new in (("plan_bool_dp", "dp = 2", "dp = true"), ("plan_float_zero", "zero = 0", "zero = 1.0"),
                           ("plan_int_layers", "layers_per_stage = [\n    4,\n]", "layers_per_stage = 4"),
                           ("plan_model_string", "[model]", 'model = "tiny"\n[model_]')):
        assert old in text, old
        _toml(d, f"{name}.toml", text.replace(old, new))
    # data files
    (d / "garbage.npy").write_bytes(bytes(range(256)) * 4)
    WritesAFileWhenUnpickled.marker = str(d / "UNPICKLED")
    np.save(d / "objects.npy", np.array([WritesAFileWhenUnpickled()] * 3, dtype=object), allow_pickle=True)
    np.save(d / "negative.npy", np.array([5, -1, 3] * 100, dtype=np.int64))
    np.save(d / "too_big.npy", np.array([1000] * 300, dtype=np.int64))
    np.save(d / "two_d.npy", np.ones((10, 30), dtype=np.int64))
    np.save(d / "floats.npy", np.ones(300, dtype=np.float32))
    np.array([300] * 300, dtype=np.uint16).tofile(d / "oov.bin")
    (d / "empty.bin").write_bytes(b"")
    for name, sidecar in (("sidecar_broken", "{not json"), ("sidecar_list", "[1, 2]"),
                          ("sidecar_dtype", '{"dtype": "int8"}'), ("sidecar_count", '{"dtype": "uint16", "tokens": 7}')):
        np.array([1, 2, 3] * 100, dtype=np.uint16).tofile(d / f"{name}.bin")
        (d / f"{name}.json").write_text(sidecar)
    (d / "binary.txt").write_bytes(b"\xff\xfe\x00\x81" * 100)
    (d / "afile").write_text("a file, not a folder\n")
    # Hugging Face folders
    for name, config in (("hf_list", "[1, 2]"), ("hf_string", '"llama"'),
                         ("hf_text_number", json.dumps({"model_type": "llama", "hidden_size": "big",
                                                        "num_attention_heads": 4, "num_hidden_layers": 2,
                                                        "intermediate_size": 8, "vocab_size": 10}))):
        (d / name).mkdir()
        (d / name / "config.json").write_text(config)
    # run folders for `report`
    for name, metrics in (("run_binary", bytes(range(256)) * 3), ("run_list_line", b"[1, 2]\n"),
                          ("run_per_rank", json.dumps({"step": 1, "step_time_s": 1.0, "tokens_per_s": 1.0,
                                                       "mfu": 0.1, "peak_memory_gib": 1.0,
                                                       "step_time_s_per_rank": 3}).encode() + b"\n")):
        (d / name).mkdir()
        good.save(d / name / "plan.toml")
        (d / name / "metrics.jsonl").write_bytes(metrics)
    (d / "empty_ck").mkdir()
    (d / "short.txt").write_text("short\n")
    (d / "hf_no_weights").mkdir()
    (d / "hf_no_weights" / "config.json").write_text(json.dumps(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
         "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256}))
    return d


# --- the cases: (argv with {d} for the folder of bad files, words the one line must contain) -------------

SPEC = [
    ("estimate --model {d}/empty.toml", "the file has no model fields"),
    ("estimate --model {d}/model_string.toml", "write a [model] table"),
    ("estimate --model {d}/model_dup.toml", "not valid TOML (Cannot overwrite a value"),
    ("estimate --model {d}/model_garbage.toml", "not valid TOML"),
    ("estimate --model {d}/model_bool.toml", "model.layers=True: must be an integer, not a bool"),
    ("estimate --model {d}/model_float.toml", "model.layers=2.5: must be an integer, not a float"),
    ("estimate --model {d}/model_nan.toml", "model.rope_theta=nan: must be a finite number"),
    ("estimate --model {d}/model_huge.toml", "model.heads=1000000000000: must be at most 16,777,216"),
    ("estimate --model {d}/model_preset_list.toml", "model.preset=[1]: unknown preset"),
    ("estimate --model preset=tiny,rope_theta=inf", "model.rope_theta=inf: must be a finite number"),
    ("estimate --model preset=tiny,norm_eps=-1", "model.norm_eps=-1.0: must be a positive finite number"),
    ("estimate --model preset=tiny,norm_eps=0", "model.norm_eps=0.0: must be a positive finite number"),
    ("estimate --model preset=tiny,layers=0", "model.layers=0: must be a positive integer"),
    ("estimate --model preset=tiny,hidden=-64", "model.hidden=-64: must be a positive integer"),
    ("estimate --model preset=tiny,vocab=100000000000", "model.vocab=100000000000: must be at most"),
    ("estimate --model preset=tiny,tied_embeddings=maybe", "expected true or false"),
    ("estimate --model preset=tiny,layers=two", "model.layers='two': expected an integer"),
    ("estimate --model gpt5", "--model='gpt5': unknown preset"),
    ("estimate --model preset=tiny,kv_heads=3", "model.kv_heads=3: must divide heads=4; valid: 1, 2, 4"),
    ("estimate --cluster {d}/cluster_list.toml", "cluster.group[0]=1: write one or more [[cluster.group]]"),
    ("estimate --cluster {d}/cluster_string.toml", "write [[cluster.group]] tables"),
    ("estimate --cluster {d}/empty.toml", "cluster.group=None: write one or more [[cluster.group]]"),
    ("estimate --cluster {d}/cluster_bool.toml", "cluster.group[0].nodes=True: must be an integer, not a bool"),
    ("estimate --cluster {d}/cluster_float.toml", "gpus_per_node=2.5: must be an integer, not a float"),
    ("estimate --cluster {d}/cluster_huge.toml", "nodes=100000000000: must be at most 1,048,576"),
    ("plan --cluster {d}/cluster_huge.toml", "nodes=100000000000: must be at most 1,048,576"),
    ("plan --cluster 100000000000x8xH100", "cluster group 0.nodes=100000000000: must be at most 1,048,576"),
    ("estimate --cluster 2000x1000xH100", "has 2,000,000 devices; fivefold plans clusters of up to 1,048,576"),
    ("estimate --cluster {d}/cluster_nan_nic.toml", "cluster.group[0].nic=nan: must be positive (and finite)"),
    ("estimate --cluster {d}/cluster_negative_mem.toml", "cluster.group[0].mem=-1: must be positive"),
    ("estimate --cluster {d}/cluster_inf_latency.toml", "nvlink_latency=inf: must be positive (and finite)"),
    ("estimate --cluster {d}/cluster_bool_tflops.toml", "peak_tflops={{'bf16': True}}: write a table of dtype"),
    ("estimate --cluster 1x4xcpu:mem=nan", "cluster group 0.mem='nan': expected a number with a unit"),
    ("estimate --cluster 1x4xcpu:speed=inf", "cluster group 0.speed='inf': write a positive factor"),
    ("estimate --cluster 1x4xcpu:nic=1e999GB/s", "nic='1e999GB/s': must be positive (and finite)"),
    ("estimate --cluster 0x4xcpu", "cluster group 0.nodes=0: must be a positive integer"),
    ("plan --model preset=tiny,layers=100000", "model.layers=100000: must be at most 4,096"),
    ("simulate --global-batch 4000000 --seq-len 64", "x 1 stages = 1,000,000 passes per step, more than the simulator"),
    ("estimate --cluster 1x4xV100", "unknown device; known: A100-40GB"),
]

LAYOUT = [
    ("estimate --seq-len 1000", "train.seq_len=1000: longer than what the model is built for (model.max_seq_len=256)"),
    ("estimate --seq-len 0", "train.seq_len=0: must be a positive integer"),
    ("estimate --global-batch -1", "train.global_batch=-1: must be a positive integer"),
    ("estimate --tp 0", "--tp=0: must be at least 1"),
    ("estimate --pp 0", "--pp=0: must be at least 1"),
    ("estimate --cp -1", "--cp=-1: must be at least 1"),
    ("estimate --dp 0", "plan.dp=0: must be an integer >= 1"),
    ("estimate --micro-batch 0", "--micro-batch=0: must be at least 1"),
    ("estimate --virtual-stages 0", "--virtual-stages=0: must be at least 1"),
    ("simulate --micro-batch -3", "--micro-batch=-3: must be at least 1"),
    ("plan --tp 0", "--tp=0: must be a positive integer"),
    ("plan --virtual-stages 0", "--virtual-stages=0: must be a positive integer"),
    ("plan --simulate-top -1", "--simulate-top=-1: must be 0 (off) or a positive count"),
    ("plan --top 0", "--top=0: must be at least 1"),
    ("plan --headroom nan", "--headroom=nan: must be a finite number"),
    ("estimate --cluster 1x2xcpu --dp 1", "plan.dp*tp*pp*cp=1: degrees must multiply to the cluster's 2 devices"),
    ("estimate --plan {d}/empty.toml", "plan=None: the plan file needs a [plan] table"),
    ("estimate --plan {d}/plan_bool_dp.toml", "plan.dp=True: must be an integer, not a bool"),
    ("estimate --plan {d}/plan_float_zero.toml", "plan.zero=1.0: must be an integer, not a float"),
    ("estimate --plan {d}/plan_int_layers.toml", "plan.layers_per_stage=4: must be a list of integers"),
    ("estimate --plan {d}/plan_model_string.toml", "the plan file needs a [model] table"),
    ("estimate --plan {d}/missing.toml", "no such file"),
]

ARGPARSE = [
    ("estimate --model", "--model: expected one argument; see `fivefold estimate --help`"),
    ("estimate --bogus", "--bogus: not a flag of this verb"),
    ("train --steps x", "--steps='x': must be an integer"),
    ("train --lr abc", "--lr='abc': must be a number"),
    ("estimate --schedule foo", "--schedule='foo': use one of gpipe, 1f1b"),
    ("estimate --dtype int8", "--dtype='int8': use one of bf16, fp16, fp32"),
    ("", "VERB: required"),
    ("teleport", "use one of plan, estimate"),
]

RUN_FLAGS = [
    ("train --nproc 1 --grad-clip 0", "--grad-clip=0.0: must be a positive finite gradient norm"),
    ("train --nproc 1 --grad-clip -1", "--grad-clip=-1.0: must be a positive finite gradient norm"),
    ("train --nproc 1 --grad-clip nan", "--grad-clip=nan: must be a finite number"),
    ("train --nproc 1 --lr nan", "--lr=nan: must be a finite number"),
    ("train --nproc 1 --lr -1", "--lr=-1.0: must be a positive finite number"),
    ("train --nproc 1 --lr 0", "--lr=0.0: must be a positive finite number"),
    ("train --nproc 1 --lr inf", "--lr=inf: must be a finite number"),
    ("train --nproc 1 --warmup-steps -1", "--warmup-steps=-1: must be 0 or more"),
    ("train --nproc 1 --seed -1", "--seed=-1: must be an integer from 0 to 2**63-1"),
    ("train --nproc 1 --steps 0", "--steps=0: must be at least 1"),
    ("train --nproc 1 --keep 0 --checkpoint-dir {d}/new_ck", "--keep=0: must keep at least 1 checkpoint"),
    ("train --nproc 1 --collective-timeout inf", "--collective-timeout=inf: must be a finite number"),
    ("train --nproc 1 --max-loss-spike nan", "--max-loss-spike=nan: must be a finite number"),
    ("train --nproc 0", "--nproc=0: must be at least 1"),
    ("train --nproc 100000", "--nproc=100000: more CPU worker processes than this machine can hold"),
    ("profile --nproc 100000", "--nproc=100000: more CPU worker processes than this machine can hold"),
    ("train --nproc 1 --init-from-hf {d}/hf_no_weights", "--init-from-hf='{d}/hf_no_weights': no model.safetensors"),
    ("train --nproc 1 --data {d}/short.txt", "--data='{d}/short.txt': has 6 tokens; one sequence needs"),
    ("train --nproc 2 --cluster 1x4xcpu", "--nproc=2: the plan needs dp*tp*pp*cp = 4 processes on 1x4xcpu"),
    ("train --nproc 1 --resume --checkpoint-dir {d}/empty_ck", "no complete checkpoint to resume from"),
]

PATHS = [
    ("train --nproc 1 --metrics-file {d}", "is a folder; give a file name, e.g."),
    ("train --nproc 1 --metrics-file {d}/afile/run/metrics.jsonl", "/afile is a file, not a folder"),
    ("train --nproc 1 --checkpoint-dir {d}/afile", "--checkpoint-dir='{d}/afile': is a file; give a folder"),
    ("train --nproc 1 --tensorboard {d}/afile", "--tensorboard='{d}/afile': is a file; give a folder"),
    ("train --nproc 1 --tensorboard {d}/afile/tb", "/afile is a file, not a folder"),
    ("plan --out {d}", "--out='{d}': is a folder; give a file name"),
    ("plan --out {d}/afile/best.toml", "/afile is a file, not a folder"),
    ("simulate --out-dir {d}/afile", "--out-dir='{d}/afile': is a file; give a folder"),
    ("profile --quick --out {d}", "--out='{d}': is a folder"),
    ("profile --quick --out {d}/afile/here.toml", "/afile is a file, not a folder"),
    ("convert --from-hf {d}/hf_list --out {d}/afile", "--out='{d}/afile': is a file; give a folder"),
]

DATA = [
    ("train --nproc 1 --data {d}", "the folder mixes"),
    ("train --nproc 1 --data {d}/missing.bin", "no such file"),
    ("train --nproc 1 --data {d}/garbage.npy", "not a .npy file (no NumPy header)"),
    ("train --nproc 1 --data {d}/objects.npy", "not a NumPy array of token ids"),
    ("train --nproc 1 --data {d}/negative.npy", "holds a negative token id (-1)"),
    ("train --nproc 1 --data {d}/too_big.npy", "holds token id 1000 but model.vocab=256"),
    ("train --nproc 1 --data {d}/oov.bin", "holds token id 300 but model.vocab=256"),
    ("train --nproc 1 --data {d}/two_d.npy", "expected a 1-D integer token array"),
    ("train --nproc 1 --data {d}/floats.npy", "expected a 1-D integer token array, got float32"),
    ("train --nproc 1 --data {d}/empty.bin", "the token file is empty"),
    ("train --nproc 1 --data {d}/sidecar_broken.bin", "sidecar_broken.json='unreadable': not a JSON sidecar"),
    ("train --nproc 1 --data {d}/sidecar_list.bin", "sidecar_list.json='list': must be a JSON object"),
    ("train --nproc 1 --data {d}/sidecar_dtype.bin", "sidecar_dtype.json:dtype='int8': use one of uint16, uint32"),
    ("train --nproc 1 --data {d}/sidecar_count.bin", "sidecar_count.json:tokens=7: but sidecar_count.bin holds 300"),
    ("train --nproc 1 --data {d}/binary.txt", "not UTF-8 text"),
    ("train --nproc 1 --init-from-hf {d}/hf_list", "config.json='list': must be a JSON object"),
    ("convert --from-hf {d}/hf_string --out {d}/converted", "config.json='str': must be a JSON object"),
    ("convert --from-hf {d}/hf_text_number --out {d}/converted", "config.json:hidden_size='big': must be an integer, not a str"),
    ("report {d}/run_binary", "is not text; a metrics file holds one JSON object per line"),
    ("report {d}/run_list_line", "metrics.jsonl:1='[1, 2]': is not a JSON object"),
    ("report {d}/run_per_rank", "step_time_s_per_rank=3: must be a list of finite numbers"),
    ("report {d}/nothing_here", "no such folder or file"),
]

CASES = SPEC + LAYOUT + ARGPARSE + RUN_FLAGS + PATHS + DATA


def snapshot(*folders: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else (-1, 0)
            for folder in folders for p in sorted(folder.rglob("*"))}


@pytest.fixture
def nothing_starts(monkeypatch):
    """A worker or a measurement starting is a failure of the case."""
    import torch.distributed.launcher.api as launcher_api

    def refuse(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(launcher_api, "elastic_launch", refuse)
    monkeypatch.setattr(fivefold.profile.run, "run_profile", refuse)


def test_at_least_60_cases_over_every_family():
    assert len(CASES) >= 60
    assert min(len(family) for family in (SPEC, LAYOUT, ARGPARSE, RUN_FLAGS, PATHS, DATA)) >= 8


def assert_refused(argv: str, words: str, bad: Path, tmp_path: Path, capsys, seconds_limit: float) -> None:
    """`fivefold ARGV` ({d} = the folder of bad files) ends in one line holding `words`, exit 2, no traceback,
    nothing written in either folder, within `seconds_limit`."""
    before = snapshot(bad, tmp_path)
    started = time.perf_counter()
    code = main(argv.format(d=bad).split())
    seconds = time.perf_counter() - started
    out, err = capsys.readouterr()
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert words.format(d=bad) in err
    assert "Traceback" not in err and out == ""
    assert snapshot(bad, tmp_path) == before  # nothing written (nor unpickled: no UNPICKLED marker)
    assert seconds < seconds_limit  # answered at once, absurd sizes included


@pytest.mark.parametrize("argv, words", CASES, ids=[argv or "(no verb)" for argv, _ in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(bad, tmp_path, monkeypatch, capsys, nothing_starts,
                                                         argv, words):
    monkeypatch.chdir(tmp_path)  # default outputs (out/simulate, profile.toml) would land here
    assert_refused(argv, words, bad, tmp_path, capsys, seconds_limit=5)


def test_json_error_is_an_object_on_stdout_and_the_line_on_stderr(capsys):
    assert main(["estimate", "--json", "--tp", "0"]) == 2
    out, err = capsys.readouterr()
    error = json.loads(out)
    assert error == {"error": "--tp=0: must be at least 1", "field": "--tp", "value": 0,
                     "fix": "must be at least 1", "exit_code": 2}
    assert err == "error: --tp=0: must be at least 1\n"


def test_json_error_of_an_unreadable_command_line(capsys):
    assert main(["train", "--json", "--steps", "x"]) == 2
    out, err = capsys.readouterr()
    error = json.loads(out)
    assert (error["field"], error["value"], error["exit_code"]) == ("--steps", "x", 2)
    assert error["fix"].startswith("must be an integer")
    assert err.count("\n") == 1


def test_pickled_objects_would_have_left_a_marker(bad, tmp_path):
    """The check above that nothing is unpickled is real: unpickling this file does create the marker."""
    WritesAFileWhenUnpickled.marker = str(tmp_path / "UNPICKLED")
    data = pickle.dumps(WritesAFileWhenUnpickled())
    pickle.loads(data)
    assert (tmp_path / "UNPICKLED").exists()
