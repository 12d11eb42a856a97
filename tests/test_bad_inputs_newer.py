"""Bad input aimed at the newer features (issue 31's families), held to the same rule as test_bad_inputs.py:
exit code 2, one line naming the flag or the file's own key, no traceback, nothing started, nothing written, at
once. Families: unbounded numbers, model sizes and dense-only fields, messages that name the deciding flag,
refusals before a search, the user's own files never appended to or shared between outputs, and foreign files
(Hugging Face config.json with values of the wrong JSON type, safetensors index files)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from test_bad_inputs import assert_refused, nothing_starts  # noqa: F401 (a fixture)

from fivefold.cli import main

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
         "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256}


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bad_newer")
    (d / "data.txt").write_text("the user's own training text, not a metrics file\n" * 20)
    for name, change in (("hf_bool_string", {"tie_word_embeddings": "false"}),
                         ("hf_float_count", {"num_hidden_layers": 4.9}),
                         ("hf_true_count", {"vocab_size": True}),
                         ("hf_kv_heads", {"num_key_value_heads": 3}),
                         ("hf_eps_text", {"rms_norm_eps": "1e-5"}),
                         ("hf_rope_list", {"rope_parameters": [1, 2]}),
                         ("hf_bad_index", {}), ("hf_index_list", {}), ("hf_index_escape", {})):
        (d / name).mkdir()
        (d / name / "config.json").write_text(json.dumps({**LLAMA, **change}))
    (d / "hf_bad_index" / "model.safetensors.index.json").write_text('{"weight_map": [1, 2]}')
    (d / "hf_index_list" / "model.safetensors.index.json").write_text("[]")
    (d / "hf_index_escape" / "model.safetensors.index.json").write_text(
        '{"weight_map": {"model.norm.weight": "../../elsewhere.safetensors"}}')
    _read_back_folders(d)
    # The modules a refusal may load are imported once per process, not per input: import them here so the
    # time bound below measures the checks alone.
    main(["train", "--nproc", "1", "--lr", "100"])
    main(["convert", "--to-hf", str(d / "ck_list" / "step-00000002"), "--out", str(d / "h")])
    return d


def _checkpoint(folder: Path, info: object) -> None:
    """A committed checkpoint folder whose manifest matches: only fivefold.json's content is wrong."""
    folder.mkdir(parents=True)
    text = json.dumps(info)
    (folder / "fivefold.json").write_text(text)
    files = {"fivefold.json": {"sha256": hashlib.sha256(text.encode()).hexdigest(), "bytes": len(text.encode())}}
    (folder / "manifest.json").write_text(json.dumps({"version": 1, "files": files}))
    (folder / "COMMIT").write_text("step 2\n")


def _read_back_folders(d: Path) -> None:
    """Run folders and checkpoints of fivefold's own kinds, with valid JSON of the wrong types."""
    from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

    plan = Plan(model=PRESETS["tiny"], cluster=parse_cluster("1x1xcpu"), train=TrainSpec(seq_len=32))
    good = {"step": 1, "step_time_s": 1.0, "tokens_per_s": 1.0, "mfu": 0.1, "peak_memory_gib": 1.0, "loss": 5.0}
    span = {"rank": 0, "step": 1, "kind": "forward", "stage": 0, "micro_batch": 0, "start": 0.0, "end": 0.1}
    for name, record, trace in (("run_step_text", {**good, "step": "1"}, None),
                                ("run_step_bool", {**good, "step": True}, None),
                                ("run_mfu_text", {**good, "mfu": "high"}, None),
                                ("run_loss_text", {**good, "loss": "x"}, None),
                                ("run_rank_strings", {**good, "step_time_s_per_rank": ["a"]}, None),
                                ("run_span_text", good, {**span, "start": "0.1"}),
                                ("run_span_backwards", good, {**span, "end": -1.0})):
        (d / name).mkdir()
        plan.save(d / name / "plan.toml")
        (d / name / "metrics.jsonl").write_text(json.dumps(record) + "\n")
        if trace is not None:
            (d / name / "trace.jsonl").write_text(json.dumps(trace) + "\n")
    model = PRESETS["tiny"].to_dict()
    state = {"step": 2, "loader": {"seed": 0, "seq_len": 32, "samples_seen": 16}}
    _checkpoint(d / "ck_list" / "step-00000002", [])
    _checkpoint(d / "ck_model_text" / "step-00000002", {"format": "fivefold-checkpoint", "model": "tiny"})
    _checkpoint(d / "ck_loader_list" / "step-00000002", {"format": "fivefold-checkpoint", "model": model,
                                                          "extra": {"train_state": {**state, "loader": [0, 32]}}})
    _checkpoint(d / "ck_step_text" / "step-00000002", {"format": "fivefold-checkpoint", "model": model,
                                                        "extra": {"train_state": {**state, "step": "2"}}})


NUMBERS = [
    ("estimate --model tiny-moe --expert-imbalance inf", "--expert-imbalance=inf: must be a finite number"),
    ("plan --model tiny-moe --expert-imbalance 1e308", "--expert-imbalance=1e+308: must be a finite number"),
    ("estimate --model tiny-moe --expert-imbalance 5000", "train.expert_imbalance=5000.0: must be from 1 to 1024"),
    ("simulate --model tiny --pp 2 --stage-time 0=inf", "SCALE in (0, 1000]"),
    ("simulate --model tiny --pp 2 --stage-time 0=1e308", "SCALE in (0, 1000]"),
    ("train --nproc 1 --lr 1e300", "--lr=1e+300: must be a finite number"),
    ("train --nproc 1 --lr 100", "--lr=100.0: must be a positive finite number up to 10"),
    ("train --nproc 1 --collective-timeout 1e300", "--collective-timeout=1e+300: must be a finite number"),
    ("train --nproc 1 --collective-timeout 1e9", "seconds up to 604,800"),
    ("train --nproc 1 --straggler-factor 1e11", "--straggler-factor=100000000000.0: must be a finite factor"),
    ("estimate --seq-len 99999999999999999999999", "--seq-len=99999999999999999999999: must be an integer below"),
    ("train --nproc 1 --seed 99999999999999999999999", "--seed=99999999999999999999999: must be an integer below"),
]

MODEL = [
    ("estimate --model preset=tiny,head_dim=99999998", "model.head_dim=99999998: must be a positive integer up to"),
    ("estimate --model preset=tiny-moe,experts=100000000", "model.experts=100000000: must be 0 (dense) or a"),
    ("estimate --model preset=tiny-moe,shared_experts=10000", "model.shared_experts=10000: must be 0 or a count"),
    ("estimate --model preset=tiny,aux_loss_coef=0.1", "model.aux_loss_coef=0.1: means nothing for a dense model"),
    ("estimate --model preset=tiny,moe_every=2", "model.moe_every=2: means nothing for a dense model"),
    ("estimate --model preset=tiny,expert_ffn_hidden=64", "model.expert_ffn_hidden=64: means nothing for a dense"),
    ("estimate --model preset=tiny,first_dense_layers=1", "model.first_dense_layers=1: means nothing for a dense"),
    ("estimate --model preset=tiny-moe,aux_loss_coef=1e9", "model.aux_loss_coef=1000000000.0: must be at most"),
    ("estimate --model tiny --expert-imbalance 2", "--expert-imbalance=2.0: means nothing for a dense model"),
    ("plan --model tiny --expert-imbalance 1.5", "--expert-imbalance=1.5: means nothing for a dense model"),
]

DECIDING_FLAG = [
    ("plan --model tiny --ep 2", "--ep=2: expert parallel needs an MoE model; tiny is dense"),
    ("plan --model tiny-moe --ep 3", "--ep=3: must divide the model's 4 experts; valid: 1, 2, 4"),
    ("plan --model tiny --cp 2 --cp-method ulysses --tp 2", "--cp-method='ulysses': Ulysses splits each tp rank's"),
    ("plan --model tiny --tp 3", "--tp=3: must divide the cluster's 4 devices"),
    ("plan --model tiny --cluster 1x8xcpu --tp 8", "--tp=8: must divide heads=4 and kv_heads=2; valid: 1, 2"),
    ("plan --model tiny --dp 4 --global-batch 6", "--dp=4: must divide --global-batch=6"),
    ("plan --model tiny --cluster 131072x8xH100 --seq-len 100000", "--seq-len=100000: longer than the model allows"),
]

USER_FILES = [
    ("train --nproc 1 --metrics-file {d}/data.txt", "exists and is not a fivefold metrics file"),
    ("train --nproc 1 --data {d}/data.txt --metrics-file {d}/data.txt", "is the same path as --metrics-file"),
    ("train --nproc 1 --checkpoint-dir {d}/run --tensorboard {d}/run", "is the same path as --checkpoint-dir"),
    ("train --nproc 1 --data {d}/data.txt --eval-data {d}/data.txt --metrics-file {d}/data.txt",
     "is the same path as --metrics-file"),
]

FOREIGN = [
    ("convert --from-hf {d}/hf_bool_string --out {d}/c", "config.json:tie_word_embeddings='false': must be true or"),
    ("convert --from-hf {d}/hf_float_count --out {d}/c", "config.json:num_hidden_layers=4.9: must be an integer, not"),
    ("convert --from-hf {d}/hf_true_count --out {d}/c", "config.json:vocab_size=True: must be an integer, not a bool"),
    ("convert --from-hf {d}/hf_kv_heads --out {d}/c", "config.json:num_key_value_heads=3: must divide heads=4"),
    ("convert --from-hf {d}/hf_eps_text --out {d}/c", "config.json:rms_norm_eps='1e-5': must be a finite number"),
    ("convert --from-hf {d}/hf_rope_list --out {d}/c", "config.json:rope_parameters=[1, 2]: must be a JSON object"),
    ("train --nproc 1 --init-from-hf {d}/hf_float_count", "config.json:num_hidden_layers=4.9: must be an integer"),
    ("convert --from-hf {d}/hf_bad_index --out {d}/c", "model.safetensors.index.json:weight_map=[1, 2]: must be a"),
    ("convert --from-hf {d}/hf_index_list --out {d}/c", "model.safetensors.index.json='list': must be a JSON object"),
    ("convert --from-hf {d}/hf_index_escape --out {d}/c", "must name a .safetensors file in the same folder"),
]

READ_BACK = [
    ("report {d}/run_step_text", "metrics.jsonl:1:step='1': must be an integer, not a str"),
    ("report {d}/run_step_bool", "metrics.jsonl:1:step=True: must be an integer, not a bool"),
    ("report {d}/run_mfu_text", "metrics.jsonl:1:mfu='high': must be a finite number"),
    ("report {d}/run_loss_text", "metrics.jsonl:1:loss='x': must be a number"),
    ("report {d}/run_rank_strings", "metrics.jsonl:1:step_time_s_per_rank=['a']: must be a list of finite numbers"),
    ("report {d}/run_span_text", "trace.jsonl:1:start='0.1': must be a finite number"),
    ("report {d}/run_span_backwards", "trace.jsonl:1:end=-1.0: must be at least 0"),
    ("convert --to-hf {d}/ck_list/step-00000002 --out {d}/h", "fivefold.json='list': must be a JSON object"),
    ("convert --to-hf {d}/ck_model_text/step-00000002 --out {d}/h", "fivefold.json:model='tiny': must be a JSON"),
    ("train --nproc 1 --model tiny --seq-len 32 --resume --checkpoint-dir {d}/ck_loader_list",
     "fivefold.json:extra.train_state:loader=[0, 32]: must be a JSON object"),
    ("train --nproc 1 --model tiny --seq-len 32 --resume --checkpoint-dir {d}/ck_step_text",
     "fivefold.json:extra.train_state:step='2': must be an integer, not a str"),
]

SERVING = [
    ("estimate --serve --model llama3-8b --cluster 1x8xH100-SXM --replicas 0", "serve.replicas=0: must be a positive"),
    ("estimate --serve --model llama3-8b --cluster 1x8xH100-SXM --max-batch 0", "serve.max_batch=0: must be a"),
    ("estimate --serve --model llama3-8b --cluster 1x8xH100-SXM --tp 0", "serve.tp=0: must be a positive integer"),
    ("estimate --serve --model llama3-8b --cluster 1x8xH100-SXM --tp 3", "--tp=3: must divide the model's 32"),
    ("estimate --serve --model llama3-8b --cluster 1x8xH100-SXM --ep 2", "--ep=2: expert parallel needs an MoE"),
    ("estimate --serve --model llama3-8b --cluster 1x8xH100-SXM --rate -1", "--rate=-1.0: must be a positive"),
    ("estimate --serve --model llama3-8b --cluster 1x8xH100-SXM --output-len 5:inf", "--output-len='5:inf'"),
    ("estimate --serve --model llama3-8b --cluster 1x8xH100-SXM --ttft-slo nan", "--ttft-slo=nan: must be a finite"),
    ("estimate --serve --model llama3-8b --cluster 1x8xH100-SXM --kv-memory 1e300", "--kv-memory=1e+300: must be"),
    ("estimate --serve --model llama3-8b --cluster 1x8xH100-SXM --gpu-memory-utilization 1.5",
     "--gpu-memory-utilization=1.5: must be a fraction of the device's memory in (0, 1]"),
    ("estimate --serve --model llama3-8b --cluster 1x8xH100-SXM --gpu-memory-utilization 0",
     "--gpu-memory-utilization=0.0: must be a fraction"),
    ("simulate --serve --model llama3-8b --cluster 1x8xH100-SXM --trace {d}/missing.csv", "--trace='{d}/missing.csv'"),
    ("plan --serve --model llama3-8b --cluster 1x8xH100-SXM --replicas 0", "--replicas=0: must be at least 1"),
]

# The flags the other new features brought (DiLoCo, optimizer and schedule, job files, generate/serve): the same
# layers check them (the parser's bound on every number, each verb's stated range).
NEWER_FLAGS = [
    ("train --nproc 4 --cluster 1x4xcpu --dp-sync diloco --outer-lr nan", "--outer-lr=nan: must be a finite number"),
    ("train --nproc 4 --cluster 1x4xcpu --dp-sync diloco --outer-lr 1e9", "--outer-lr=1000000000.0: must be a"),
    ("train --nproc 4 --cluster 1x4xcpu --dp-sync diloco --outer-momentum 1.5", "--outer-momentum=1.5: must be from"),
    ("train --nproc 4 --cluster 1x4xcpu --dp-sync diloco --sync-every 0", "--sync-every=0: must be 1 to"),
    ("train --nproc 4 --cluster 1x4xcpu --sync-every 5", "--sync-every=5: needs --dp-sync diloco"),
    ("train --nproc 4 --cluster 1x4xcpu --dp-sync diloco --diloco-groups 3 --dp 4", "--diloco-groups=3: must divide"),
    ("train --nproc 1 --betas 2,0.9", "--betas='2,0.9': must be two numbers in [0, 1)"),
    ("train --nproc 1 --eps 0", "--eps=0.0: must be a positive finite number"),
    ("train --nproc 1 --min-lr 1", "--min-lr=1.0: must be a finite number from 0 to --lr"),
    ("train --nproc 1 --weight-decay inf", "--weight-decay=inf: must be a finite number"),
    ("train --nproc 1 --config {d}/missing.toml", "--config='{d}/missing.toml': no such file"),
    ("generate --from-hf {d}/hf_float_count --input {d}/in.jsonl --output {d}/o.jsonl --max-tokens 0",
     "--max-tokens=0: must be at least 1"),
    ("generate --from-hf {d}/hf_float_count --input {d}/in.jsonl --output {d}/o.jsonl --temperature nan",
     "--temperature=nan: must be a finite number"),
    ("serve --from-hf {d}/hf_float_count --port 99999", "--port=99999: must be in 0..65535"),
    ("serve --from-hf {d}/hf_float_count --gpu-memory-utilization nan", "--gpu-memory-utilization=nan: must be a"),
]

SIZES = [
    ("dryrun --model tiny --global-batch 100000 --seq-len 32 --cluster 1x1xcpu", "more than the dry run steps (1,024)"),
    ("simulate --model tiny --global-batch 4000000 --seq-len 32", "more than the simulator replays"),
]

CASES = NUMBERS + MODEL + DECIDING_FLAG + USER_FILES + FOREIGN + READ_BACK + SIZES + SERVING + NEWER_FLAGS


@pytest.mark.parametrize("argv, words", CASES, ids=[argv for argv, _ in CASES])
def test_newer_bad_input_is_one_line_exit_2_and_writes_nothing(bad, tmp_path, monkeypatch, capsys, nothing_starts,
                                                               argv, words):
    monkeypatch.chdir(tmp_path)
    assert_refused(argv, words, bad, tmp_path, capsys, seconds_limit=2)  # any refusal at once, for any input size


def test_every_float_and_int_flag_is_bounded_by_the_parser():
    """A flag declared with type=float or type=int anywhere is checked by the parser (cliparse.OneLineParser),
    so a flag a later feature adds is covered without a check of its own."""
    from fivefold.cliparse import OneLineParser

    parser = OneLineParser(prog="x")
    group = parser.add_argument_group("g")
    group.add_argument("--brand-new", type=float, default=1.0)
    group.add_argument("--new-count", type=int, default=1)
    for argv, words in ((["--brand-new", "nan"], "--brand-new=nan"), (["--brand-new=-1e13"], "--brand-new=-10000000000000.0"),
                        (["--new-count", str(2**64)], "--new-count=18446744073709551616")):
        with pytest.raises(Exception) as info:
            parser.parse_args(argv)
        assert words in str(info.value)
    assert parser.parse_args(["--brand-new", "0.5"]).brand_new == 0.5


def test_plan_out_is_written_only_after_every_check(tmp_path, capsys):
    """`plan --out` with a --dryrun-top that refuses writes no plan file."""
    import fivefold.dryrun.report

    def refuse(plans, log=None):
        from fivefold.errors import SpecError

        raise SpecError("--dryrun-top", 1, "refused for the test")

    out = tmp_path / "best.toml"
    original = fivefold.dryrun.report.check_top
    fivefold.dryrun.report.check_top = refuse
    try:
        assert main(["plan", "--model", "tiny", "--dryrun-top", "1", "--out", str(out)]) == 2
    finally:
        fivefold.dryrun.report.check_top = original
    assert not out.exists()
    assert "refused for the test" in capsys.readouterr().err


def test_an_existing_fivefold_metrics_file_is_still_accepted(tmp_path):
    from fivefold.outputs import check_metrics_file

    mine = tmp_path / "metrics.jsonl"
    mine.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    assert check_metrics_file(mine) == mine
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert check_metrics_file(empty) == empty
