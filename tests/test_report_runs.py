"""Real traced runs, then `fivefold report` on them: 2 processes each on the tiny model, 4 steps
(data parallel; a 1F1B pipeline; a zero-bubble V pipeline). Checks what the runtime wrote (per-rank
lists, every action of every traced step) and that the report's numbers are the files' numbers."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fivefold.cli import main
from fivefold.cost import estimate, stack_named
from fivefold.spec import load_plan

pytestmark = pytest.mark.slow
RUNS = {  # name: layout flags; 8 sequences of 32 tokens per step, micro-batches of 2
    "dp2": ["--dp", "2"],
    "pp2": ["--pp", "2"],
    "zbv": ["--pp", "2", "--schedule", "zbv"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("traced")
    folders = {}
    for name, layout in RUNS.items():
        folder = root / name
        result = subprocess.run(
            [sys.executable, "-m", "fivefold", "train", "--cluster", "1x2xcpu", *layout, "--micro-batch", "2",
             "--seq-len", "32", "--steps", "4", "--device", "cpu", "--metrics-file", str(folder / "metrics.jsonl"),
             "--trace", "--metrics-every", "1"], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        folders[name] = folder
    return folders


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("name", RUNS)
def test_metrics_carry_per_rank_memory_and_step_time(runs, name):
    records = read_jsonl(runs[name] / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        memory, own = r["peak_memory_gib_per_rank"], r["step_time_s_per_rank"]
        assert len(memory) == len(own) == 2
        assert all(0.05 < m < 8 and 0 < t < 60 for m, t in zip(memory, own))
        assert r["peak_memory_gib"] == max(memory)
        assert own[0] <= r["step_time_s"]  # rank 0's own step ends before the gathers that close the step
        assert r["first_step"] == 1


@pytest.mark.parametrize("name", RUNS)
def test_trace_has_every_action_of_every_traced_step(runs, name):
    plan = load_plan(runs[name] / "plan.toml")
    spans = read_jsonl(runs[name] / "trace.jsonl")
    assert {s["step"] for s in spans} == {3, 4} and {s["rank"] for s in spans} == {0, 1}
    split = plan.schedule == "zbv"
    for rank in (0, 1):
        pp_rank = plan.coords(rank)["pp"]
        micro_batches = plan.micro_batches_of_replica(plan.coords(rank)["dp"])
        for step in (3, 4):
            mine = [s for s in spans if s["rank"] == rank and s["step"] == step]
            whole = [s for s in mine if s["kind"] == "step"]
            assert len(whole) == 1 and all(s["pp_rank"] == pp_rank for s in mine)
            actions = sorted((s for s in mine if s["kind"] != "step"), key=lambda s: s["start"])
            assert all(whole[0]["start"] <= s["start"] <= s["end"] <= whole[0]["end"] for s in actions)
            for before, after in zip(actions, actions[1:]):  # one thread: spans never overlap
                assert before["end"] <= after["start"] + 1e-6
            counts: dict = {}
            for s in actions:
                counts[s["kind"], s["stage"]] = counts.get((s["kind"], s["stage"]), 0) + 1
            expected = {("optimizer", -1): 1}
            for stage in plan.stages_of(pp_rank):
                for kind in (("F", "I", "W") if split else ("F", "B")):
                    expected[kind, stage] = micro_batches
            assert counts == expected
    chrome = json.loads((runs[name] / "trace.json").read_text())
    assert sum(1 for e in chrome["traceEvents"] if e["ph"] == "X") == len(spans)


@pytest.mark.parametrize("name", RUNS)
def test_report_numbers_are_the_files_numbers(runs, name, capsys):
    folder = runs[name]
    assert main(["report", str(folder), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    plan = load_plan(folder / "plan.toml")
    records = read_jsonl(folder / "metrics.jsonl")
    measured = statistics.median(r["step_time_s"] for r in records[2:])  # steps 3-4 after the 2 warm-up steps
    predicted = estimate(plan, stack_named(report["stack"])).step_time_s
    assert report["step_time_s"]["measured"] == pytest.approx(measured)
    assert report["step_time_s"]["error_pct"] == pytest.approx(100 * (predicted - measured) / measured)
    memory1 = statistics.median(r["peak_memory_gib_per_rank"][1] for r in records[2:])
    assert report["ranks"][1]["memory_gib"]["measured"] == pytest.approx(memory1)
    for key in ("step_time_s", "tokens_per_s", "mfu_pct"):
        for field in ("predicted", "simulated", "measured", "error_pct"):
            assert math.isfinite(report[key][field]) and (field == "error_pct" or report[key][field] > 0)
    # one part by hand: the last pp rank's forward of its last stage, summed per step, median over steps
    spans = read_jsonl(folder / "trace.jsonl")
    last_rank, last_stage = plan.rank_of(pp=plan.pp - 1), plan.stages_of(plan.pp - 1)[-1]
    sums = [sum(s["end"] - s["start"] for s in spans if s["rank"] == last_rank and s["step"] == step
                and s["kind"] == "F" and s["stage"] == last_stage) for step in (3, 4)]
    part = next(s for s in report["sources"]
                if s["pp_rank"] == plan.pp - 1 and s["what"] == f"forward, stage {last_stage}")
    assert part["measured_s"] == pytest.approx(statistics.median(sums))
    assert len(report["largest_sources_of_error"]) == 3
    assert report["largest_sources_of_error"] == report["sources"][:3]
    picture = folder / "report-timeline.png"
    assert report["timeline"] == str(picture) and picture.stat().st_size > 20_000


def test_report_runs_without_torch(runs):
    script = textwrap.dedent(f"""
        import importlib.abc, sys
        class NoTorch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked")
        sys.meta_path.insert(0, NoTorch())
        from fivefold.cli import main
        sys.exit(main(["report", {str(runs['pp2'])!r}]))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "largest sources of error" in result.stdout
