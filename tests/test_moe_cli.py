"""MoE through the command line: `fivefold train` of tiny-moe with --ep writes the auxiliary loss and the
expert load into the metrics file, `fivefold report` shows them, and bad MoE layouts stop in one line."""

from __future__ import annotations

import json
import statistics

import pytest

from fivefold.cli import main


@pytest.mark.parametrize("argv, message", [
    (["--cluster", "1x4xcpu", "--ep", "3"], "error: plan.ep=3: --ep must divide model.experts=4; valid: 1, 2, 4"),
    (["--cluster", "1x4xcpu", "--ep", "2", "--etp", "4"], "error: plan.ep=2: --ep x --etp = 8 must divide "
     "tp*cp*dp=4"),
])
def test_bad_moe_layouts_stop_with_one_line(capsys, argv, message):
    assert main(["train", "--device", "cpu", "--model", "tiny-moe", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err


def test_uneven_replicas_and_tokens_that_tp_cannot_split_are_refused():
    from fivefold.errors import SpecError
    from fivefold.runtime.expert_parallel import check_moe_runnable
    from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

    uneven = Plan(model=PRESETS["tiny-moe"], cluster=parse_cluster("1x2xcpu"), train=TrainSpec(seq_len=32, global_batch=8),
                  dp=2, ep=2, micro_batch=1, replica_micro_batches=(3, 5))
    with pytest.raises(SpecError, match="uneven replicas cannot share experts"):
        check_moe_runnable(uneven)
    check_moe_runnable(uneven.replace(cp=2, dp=1, replica_micro_batches=(), micro_batch=1))  # aux loss under cp runs
    odd = Plan(model=PRESETS["tiny-moe"], cluster=parse_cluster("1x4xcpu"), train=TrainSpec(seq_len=9, global_batch=8),
               dp=2, tp=2, ep=2)
    with pytest.raises(SpecError, match="train.seq_len=9: the MoE layers split each rank's 9 tokens of a "
                                        "sequence over tp=2: use a --seq-len divisible by cp x tp = 2"):
        check_moe_runnable(odd.replace(sequence_parallel=False))


@pytest.mark.slow
def test_train_with_ep_writes_moe_metrics_and_report_shows_them(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--device", "cpu", "--model", "tiny-moe", "--cluster", "1x2xcpu", "--ep", "2",
                 "--steps", "4", "--seq-len", "32", "--global-batch", "4", "--metrics-file",
                 str(run / "metrics.jsonl")]) == 0
    capsys.readouterr()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert 0.005 < record["aux_loss"] < 0.05  # coefficient 0.01 x top_k 2 near balance
        assert 1.0 <= record["expert_load_max_over_mean"] <= 4.0 and len(record["expert_load_per_layer"]) == 4
    assert main(["report", str(run), "--json"]) == 0
    moe = json.loads(capsys.readouterr().out)["moe"]
    measured = records[2:]  # after the two warm-up steps
    assert moe["aux_loss_median"] == pytest.approx(statistics.median(r["aux_loss"] for r in measured))
    assert moe["expert_load_max_over_mean_worst"] == max(r["expert_load_max_over_mean"] for r in measured)
    assert main(["report", str(run)]) == 0
    assert "mixture of experts: auxiliary loss" in capsys.readouterr().out


@pytest.mark.slow
def test_loss_guard_skips_a_bad_moe_step(tmp_path, capsys, monkeypatch):
    from fivefold.elastic.guard import INJECT_ENV

    monkeypatch.setenv(INJECT_ENV, "2:nan")
    metrics = tmp_path / "metrics.jsonl"
    assert main(["train", "--device", "cpu", "--model", "preset=tiny-moe,router_bias_rate=0.01", "--cluster",
                 "1x1xcpu", "--steps", "3", "--seq-len", "32", "--global-batch", "4",
                 "--metrics-file", str(metrics)]) == 0
    capsys.readouterr()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["skipped"] for r in records] == [False, True, False]
    assert all(r["aux_loss"] > 0 and r["expert_load_max_over_mean"] >= 1.0 for r in records)
