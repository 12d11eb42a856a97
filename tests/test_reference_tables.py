"""The development-set training tables of bench/reference/ (issue 25): every row of every table parses into a
plan and a prediction, and every row names its source, which the README's section for the table cites."""

from __future__ import annotations

import csv
import importlib.util
import math
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "bench" / "reference"
sys.path.insert(0, str(ROOT / "bench"))
_spec = importlib.util.spec_from_file_location("validation_moe", ROOT / "bench" / "validation_moe.py")
validation_moe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(validation_moe)


def _training_tables() -> dict[str, list[dict]]:
    """name -> raw CSV rows of every table with a `source` column (the kernel tables have none)."""
    out = {}
    for path in sorted(REFERENCE.glob("*.csv")):
        with open(path) as handle:
            rows = list(csv.DictReader(handle))
        if rows and "source" in rows[0]:
            out[path.name] = rows
    return out


def _readme_sections() -> dict[str, str]:
    sections: dict[str, str] = {}
    name = None
    for line in (REFERENCE / "README.md").read_text().splitlines():
        if line.startswith("## "):
            name = line[3:].split(" ")[0]
            sections[name] = ""
        elif name:
            sections[name] += line + "\n"
    return sections


def test_every_training_table_row_parses_and_is_predicted() -> None:
    raw = _training_tables()
    predicted = validation_moe.dev_set_tables(REFERENCE)
    assert set(raw) == set(predicted), "a table in bench/reference/ has no reader in validation_moe.dev_set_tables"
    for name, rows in predicted.items():
        assert len(rows) == len(raw[name]), name
        for row in rows:
            assert row["measured"] > 0, (name, row)
            # a row the model cannot express says why (its layout), every other one has a finite prediction
            assert row["predicted"] is None and row["layout"] or math.isfinite(row["predicted"]), (name, row)


def test_every_training_row_names_its_source_and_the_readme_cites_it() -> None:
    sections = _readme_sections()
    for name, rows in _training_tables().items():
        assert name in sections, f"bench/reference/README.md has no section for {name}"
        for row in rows:
            source = row["source"].strip()
            repo_or_paper, _, path = source.partition(" ")
            assert source and repo_or_paper, (name, row)
            # the README names the repository or paper and the file or table the row was copied from
            cited = sections[name]
            assert repo_or_paper.split("@")[0] in cited and path.split(" ")[0] in cited, (name, source)


def test_megatron_flops_count_reproduces_the_modelzoo_tables_own_tflops() -> None:
    """The TFLOP/s-only rows are converted with Megatron's FLOPs per token; on the rows that report both a step
    time and TFLOP/s (megatron_moe_h100.csv) the count gives back the reported TFLOP/s within 1%."""
    from reference_rows import megatron_flops_per_token

    from fivefold.spec import PRESETS

    checked = 0
    with open(REFERENCE / "megatron_moe_h100.csv") as handle:
        for row in csv.DictReader(handle):
            tokens = int(row["global_batch"]) * int(row["seq_len"]) / float(row["step_time_s"]) / int(row["gpus"])
            tflops = tokens * megatron_flops_per_token(PRESETS[row["model"]], int(row["seq_len"])) / 1e12
            assert abs(tflops / float(row["tflops_per_gpu"]) - 1) < 0.01, (row, tflops)
            checked += 1
    assert checked == 5
    # by hand (Qwen3-235B-A22B, seq 4096): per layer 2*4096*(8192+1024) + 2*8192*4096 + 2*4096*8192
    # + 2*3*4096*1536*8, 94 layers, logits 2*4096*151936, times 3
    layer = 2 * 4096 * 9216 + 2 * 8192 * 4096 + 2 * 4096 * 8192 + 6 * 4096 * 1536 * 8
    assert megatron_flops_per_token(PRESETS["qwen3-235b-a22b"], 4096) == 3 * (94 * layer + 2 * 4096 * 151936)


def test_transformer_engine_table_is_consistent_with_the_ratios_its_guide_states() -> None:
    """Each row's per-layer time is the sum of its three passes (as transcribed), and the autocast speed-ups over
    BF16 are the guide's own 1.69x / 1.58x / 1.40x (delayed / current / block scaling)."""
    with open(REFERENCE / "te_h200nvl_gemm_layer.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 7
    for row in rows:
        passes = float(row["fprop_ms"]) + float(row["dgrad_ms"]) + float(row["wgrad_ms"])
        # the guide's own pre-quantized BF16 total (31.968 ms = its 767.242 ms / 24 layers) is 0.059 ms above
        # the sum of its passes (31.909); kept as printed (README)
        slack = 0.06 if (row["mode"], row["recipe"]) == ("pre-quantized", "bf16") else 0.002
        assert abs(passes - float(row["layer_ms"])) < slack, row
    speedups = {recipe: round(measured, 2) for recipe, measured, _ in validation_moe.te_fp8_speedups(REFERENCE)}
    assert speedups == {"fp8-delayed": 1.69, "fp8-current": 1.58, "fp8-blockwise": 1.40}
    shapes = validation_moe.te_layer_gemm_shapes()
    assert len(shapes) == 12
    # 3 passes x 2 x M x (4096 * 12288 + 4096 * 4096 + 2 * 4096 * 16384) FLOPs per layer
    assert sum(2 * m * n * k for m, n, k in shapes) == 3 * 2 * 15872 * 4096 * (12288 + 4096 + 2 * 16384)


def test_reference_models_have_their_published_sizes() -> None:
    """The dev-set MoE models that are not presets (reference_rows.REFERENCE_MODELS) have the sizes their names
    and model cards state: Mixtral 8x22B 141B total / 39B active (Mistral AI), Qwen2-57B-A14B 57B / 14B, and
    G8T8 keeps Mixtral's total with 8 of 64 experts of 1/8 width active (the same 2 x 16384 active width)."""
    from reference_rows import REFERENCE_MODELS

    sizes = {name: (round(m.num_params() / 1e9), round(m.active_params_per_token() / 1e9))
             for name, m in REFERENCE_MODELS.items()}
    assert sizes == {"mixtral-8x22b": (141, 39), "mixtral-8x22b-g8t8": (141, 22), "qwen2-57b-a14b": (57, 14)}


def test_mfu_rows_become_tokens_through_megatrons_count() -> None:
    """A row that reports only MFU: tokens/s per GPU = MFU x 989.5 TFLOP/s / Megatron's FLOPs per token."""
    from reference_rows import REFERENCE_MODELS, measured_tokens_per_s, megatron_flops_per_token

    row = {"model": "mixtral-8x22b", "seq_len": "4096", "gpus": "128", "global_batch": "256", "step_time_s": "",
           "tflops_per_gpu": "", "mfu_pct": "49.3"}
    flops = megatron_flops_per_token(REFERENCE_MODELS["mixtral-8x22b"], 4096)
    # by hand: 56 layers of 2*6144*(6144+2*1024) + 2*6144*6144 + 2*4096*6144 + 2*3*6144*16384*2, logits 2*6144*32000
    layer = 2 * 6144 * 8192 + 2 * 6144 * 6144 + 2 * 4096 * 6144 + 12 * 6144 * 16384
    assert flops == 3 * (56 * layer + 2 * 6144 * 32000)
    assert abs(measured_tokens_per_s(row) / (0.493 * 989.5e12 / flops) - 1) < 1e-12
