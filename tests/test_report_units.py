"""`fivefold report` on hand-written run folders: medians, errors and parts of a step checked against
numbers computed by hand from the files, the picture, and every bad input ending in one line, exit 2."""

from __future__ import annotations

import json
import statistics

import pytest

from fivefold.cli import main
from fivefold.cost import estimate, stack_named
from fivefold.report import WARMUP_STEPS, default_stack, load_run, report_run
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

MS = 1e-3
PLAN = Plan(model=PRESETS["tiny"], cluster=parse_cluster("1x2xcpu"), train=TrainSpec(seq_len=32, global_batch=8),
            pp=2, micro_batch=2)  # 1F1B, 4 micro-batches, stages 0 and 1 on pp ranks 0 and 1
TOKENS = 8 * 32
STEP_TIMES = [1.0, 0.5, 0.030, 0.034]
MEMORY = [[0.2, 0.2], [0.25, 0.3], [0.30, 0.40], [0.32, 0.44]]
OWN_TIMES = [[0.9, 0.9], [0.4, 0.4], [0.028, 0.029], [0.031, 0.030]]


def metrics_lines(per_rank: bool = True) -> list[str]:
    lines = []
    for index, step_time in enumerate(STEP_TIMES):
        record = {"step": index + 1, "loss": 5.0, "grad_norm": 1.0, "lr": 1e-3, "tokens": TOKENS * (index + 1),
                  "step_time_s": step_time, "tokens_per_s": TOKENS / step_time, "mfu": 0.01 * (index + 1),
                  "peak_memory_gib": max(MEMORY[index])}
        if per_rank:
            record |= {"peak_memory_gib_per_rank": MEMORY[index], "step_time_s_per_rank": OWN_TIMES[index]}
        lines.append(json.dumps(record))
    return lines


def rank_spans(rank: int, step: int, start: float, forward: float, backward: float, length: float) -> list[dict]:
    """One rank's spans of one step: 4 forwards, 4 backwards, the optimizer (1 ms), laid end to end."""
    spans = [{"rank": rank, "pp_rank": rank, "step": step, "kind": "step", "stage": -1, "micro_batch": -1,
              "start": start, "end": start + length}]
    t = start + 0.5 * MS
    for kind, seconds in (("F", forward), ("B", backward)):
        for micro_batch in range(4):
            spans.append({"rank": rank, "pp_rank": rank, "step": step, "kind": kind, "stage": rank,
                          "micro_batch": micro_batch, "start": t, "end": t + seconds})
            t += seconds
    spans.append({"rank": rank, "pp_rank": rank, "step": step, "kind": "optimizer", "stage": -1, "micro_batch": -1,
                  "start": t, "end": t + 1 * MS})
    return spans


def trace_lines() -> list[str]:
    spans = []
    for step, origin in ((3, 1000.0), (4, 1001.0)):
        # pp0: F 2 / 2.5 ms, B 3 / 3.5 ms, step 30 / 34 ms; pp1 starts 1 ms later: F 2, B 4, step 29 / 33 ms
        spans += rank_spans(0, step, origin, (2.0 if step == 3 else 2.5) * MS, (3.0 if step == 3 else 3.5) * MS,
                            (30 if step == 3 else 34) * MS)
        spans += rank_spans(1, step, origin + 1 * MS, 2 * MS, 4 * MS, (29 if step == 3 else 33) * MS)
    return [json.dumps(s) for s in spans]


def write_run(folder, metrics=None, trace=True, plan=True):
    folder.mkdir(parents=True, exist_ok=True)
    if plan:
        PLAN.save(folder / "plan.toml")
    (folder / "metrics.jsonl").write_text("\n".join(metrics_lines() if metrics is None else metrics) + "\n")
    if trace:
        (folder / "trace.jsonl").write_text("\n".join(trace_lines()) + "\n")
    return folder


def test_figures_and_per_rank_rows_are_medians_after_the_warm_up(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    assert main(["report", str(run), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    predicted = estimate(PLAN, stack_named(default_stack()))
    assert WARMUP_STEPS == 2 and report["warmup_steps"] == 2 and report["measured_steps"] == [3, 4]
    assert report["stack"] == default_stack()
    step = report["step_time_s"]
    assert step["measured"] == pytest.approx(0.032)  # median of 0.030 and 0.034
    assert step["predicted"] == pytest.approx(predicted.step_time_s)
    assert step["error_pct"] == pytest.approx(100 * (predicted.step_time_s - 0.032) / 0.032)
    assert report["tokens_per_s"]["measured"] == pytest.approx((TOKENS / 0.030 + TOKENS / 0.034) / 2)
    assert report["mfu_pct"]["measured"] == pytest.approx(100 * 0.035)
    rank1 = report["ranks"][1]
    assert rank1["coords"] == {"pp": 1, "dp": 0, "cp": 0, "tp": 0}
    assert rank1["memory_gib"]["measured"] == pytest.approx(0.42)
    assert rank1["memory_gib"]["predicted"] == pytest.approx(predicted.rank_memory[1].total / 2**30)
    predicted_gib = predicted.rank_memory[1].total / 2**30
    assert rank1["memory_gib"]["error_pct"] == pytest.approx(100 * (predicted_gib - 0.42) / 0.42)
    assert report["ranks"][0]["step_time_s"]["measured"] == pytest.approx(0.0295)


def test_parts_of_the_step_and_largest_sources_from_the_trace(tmp_path):
    report = report_run(str(write_run(tmp_path / "run")))
    predicted = estimate(PLAN, stack_named(default_stack()))
    assert report.traced_steps == [3, 4] and report.timeline_step == 3  # 30 ms is the median (lower) length
    by_key = {(s.pp_rank, s.what): s for s in report.sources}
    # measured: medians over steps 3 and 4 of the sums per step, by hand
    expected = {(0, "forward, stage 0"): 9 * MS, (0, "backward, stage 0"): 13 * MS, (0, "optimizer"): 1 * MS,
                (0, "other: bubble, exposed communication, host work"): 9 * MS,  # 30-21 and 34-25
                (1, "forward, stage 1"): 8 * MS, (1, "backward, stage 1"): 16 * MS, (1, "optimizer"): 1 * MS,
                (1, "other: bubble, exposed communication, host work"): 6 * MS}  # 29-25 and 33-25
    assert set(by_key) == set(expected)
    for key, seconds in expected.items():
        assert by_key[key].measured_s == pytest.approx(seconds), key
    # predicted: the simulator runs each stage's F and B from the cost model's StageCost, 4 micro-batches
    stage1 = predicted.stage_costs[1]
    assert by_key[(1, "forward, stage 1")].predicted_s == pytest.approx(4 * stage1.forward)
    assert by_key[(1, "backward, stage 1")].predicted_s == pytest.approx(
        4 * (stage1.backward_input + stage1.backward_weight))
    assert by_key[(1, "backward, stage 1")].count == 4 and by_key[(1, "optimizer")].count == 1
    errors = [abs(s.error_s) for s in report.sources]
    assert errors == sorted(errors, reverse=True)
    assert report.sources[0].error_s == pytest.approx(report.sources[0].predicted_s - report.sources[0].measured_s)
    # where the step goes: the busiest measured pp rank is pp1 (24 ms of F/B against 22 ms)
    measured = {part["part"]: part["measured_s"] for part in report.breakdown}
    assert measured == pytest.approx({"compute": 24 * MS, "optimizer": 1 * MS, "other": 6 * MS})
    picture = tmp_path / "run" / "report-timeline.png"
    assert report.timeline == str(picture)
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 20_000


def test_text_report_names_three_sources_and_the_picture(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    assert main(["report", str(run / "metrics.jsonl")]) == 0  # the metrics file works as well as its folder
    out = capsys.readouterr().out
    for text in ("step time", "tokens/s", "MFU", "per rank", "where the step goes", "largest sources of error",
                 "  1. ", "  2. ", "  3. ", "report-timeline.png"):
        assert text in out, text
    assert "  4. " not in out


def test_without_trace_or_per_rank_lists_the_report_says_so(tmp_path):
    run = write_run(tmp_path / "run", metrics=metrics_lines(per_rank=False), trace=False)
    report = report_run(str(run))
    assert report.timeline is None and report.traced_steps == []
    assert len(report.sources) == 1 and report.sources[0].measured_s == pytest.approx(0.032)
    assert any("--trace" in note for note in report.notes)
    assert any("per-rank" in note for note in report.notes)
    assert report.ranks[0]["memory_gib"]["measured"] == pytest.approx(0.42)  # the busiest rank's, median
    assert not (run / "report-timeline.png").exists()


def test_a_reused_folder_reports_its_last_run_and_a_short_run_keeps_a_step(tmp_path):
    first = metrics_lines()
    second = [json.dumps({**json.loads(line), "step_time_s": 0.05}) for line in metrics_lines()[:2]]
    run = load_run(write_run(tmp_path / "run", metrics=first + second, trace=False))
    assert [r["step"] for r in run.records] == [1, 2]
    assert run.warmup_steps == 1 and [r["step"] for r in run.measured] == [2]
    resumed = metrics_lines() + [json.dumps({**json.loads(line), "step": 4 + n, "first_step": 5})
                                 for n, line in enumerate(metrics_lines(), 1)]  # resumed after step 4
    run = load_run(write_run(tmp_path / "resumed", metrics=resumed, trace=False))
    assert [r["step"] for r in run.records] == [5, 6, 7, 8] and [r["step"] for r in run.measured] == [7, 8]
    truncated = metrics_lines() + ['{"step": 5, "loss"']  # a run killed while writing
    assert len(load_run(write_run(tmp_path / "cut", metrics=truncated, trace=False)).records) == 4


@pytest.mark.parametrize("make, argv_tail, message", [
    (lambda p: None, [], "error: run="),
    (lambda p: write_run(p, plan=False), [], "error: plan="),
    (lambda p: (p.mkdir(), (p / "notes.txt").write_text("x")), [], "error: run="),
    (lambda p: write_run(p, metrics=[]), [], "error: run="),
    (lambda p: write_run(p, metrics=[metrics_lines()[0], "not json", metrics_lines()[1]]), [], "metrics.jsonl:2="),
    (lambda p: write_run(p, metrics=[json.dumps({"step": 1})]), [], "metrics.jsonl:1="),
    (lambda p: write_run(p, metrics=[json.dumps({**json.loads(metrics_lines()[0]),
                                                 "peak_memory_gib_per_rank": [0.1, 0.2, 0.3]})]), [],
     "peak_memory_gib_per_rank=3"),
    (lambda p: write_run(p), ["--stack", "nope"], "error: --stack='nope'"),
    (lambda p: (write_run(p), (p / "trace.jsonl").write_text('{"rank": 0, "step": 3}\n')), [], "trace.jsonl:1="),
])
def test_bad_input_ends_in_one_line_and_exit_2(tmp_path, capsys, make, argv_tail, message):
    folder = tmp_path / "run"
    make(folder)
    assert main(["report", str(folder), *argv_tail]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("error: ") and message in err, err


def test_measured_medians_match_a_direct_reading_of_the_file(tmp_path):
    run = load_run(write_run(tmp_path / "run"))
    assert statistics.median(r["step_time_s"] for r in run.measured) == pytest.approx(0.032)
    assert {span["rank"] for span in run.trace} == {0, 1} and run.trace_path.name == "trace.jsonl"
