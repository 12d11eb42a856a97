"""`fivefold generate --trace --metrics-file` records a serving run and `fivefold report` reads it: the figures
against numbers computed by hand from the run's files, the step records against the token arithmetic of the
trace, and every bad file or flag ending in one line, exit 2. One process, a 2-layer model of hidden 32."""

from __future__ import annotations

import json

import pytest

from fivefold.cli import main
from fivefold.report.serving import percentile
from serve_models import save_model

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TRACE = [(0.0, 9, 5), (0.01, 12, 3), (0.02, 5, 6), (0.05, 7, 4)]  # arrival_s, prompt_tokens, output_tokens


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A recorded generate run of TRACE: (run folder, report --json)."""
    tmp = tmp_path_factory.mktemp("serving-run")
    _, folder = save_model(tmp / "llama")
    trace = tmp / "trace.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(f"{a},{p},{o}\n" for a, p, o in TRACE))
    run = tmp / "run"
    assert main(["generate", "--from-hf", str(folder), "--trace", str(trace), "--output", str(tmp / "out.jsonl"),
                 "--metrics-file", str(run / "requests.jsonl"), "--cluster", "1x1xcpu", "--max-tokens-per-step",
                 "16"]) == 0
    return run, folder, trace


def report_json(run, capsys) -> dict:
    capsys.readouterr()
    assert main(["report", str(run), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_report_compares_the_recorded_prediction_with_the_requests(served, capsys):
    run, _, _ = served
    report = report_json(run, capsys)
    requests = [json.loads(line) for line in (run / "requests.jsonl").read_text().splitlines()]
    assert report["kind"] == "serving" and report["requests"] == len(TRACE)
    # The trace's lengths, each request exactly its output length (end tokens ignored under --trace).
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in requests] == [(p, o) for _, p, o in TRACE]
    ttft = [r["ttft_s"] for r in requests]
    tpot = [r["tpot_s"] for r in requests]
    assert report["ttft_p50_s"]["measured"] == percentile(ttft, 0.5)
    assert report["tpot_p90_s"]["measured"] == percentile(tpot, 0.9)
    assert report["ttft_mean_s"]["measured"] == pytest.approx(sum(ttft) / len(ttft))
    span = max(r["arrival_s"] + r["total_s"] for r in requests) - min(r["arrival_s"] for r in requests)
    assert report["output_tokens_per_s"]["measured"] == pytest.approx(sum(o for _, _, o in TRACE) / span)
    recorded = json.loads((run / "serve_run.json").read_text())
    assert recorded["layout"]["tp"] == 1 and recorded["cluster_label"] == "1x1xcpu"
    assert report["ttft_p90_s"]["predicted"] == recorded["prediction"]["estimate"]["ttft_s"]["p90"]
    assert report["tpot_p50_s"]["simulated"] == recorded["prediction"]["simulated"]["tpot_s"]["p50"]
    # One process: the engine's share of a core while runnable, no workers; a catalog cluster has no probe.
    assert 0.0 < report["cpu_share"]["engine"] <= 1.0
    assert report["cpu_share"]["workers"] is None and report["cpu_share"]["profile"] is None


def test_the_steps_hold_every_token_of_the_trace(served):
    """Each step computes its requests' new tokens: every prompt token once and every output token but the last
    fed back (no preemption here); each sampled row gives one output token; 16 tokens a step at most."""
    run, _, _ = served
    steps = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    assert sum(s["tokens"] for s in steps) == sum(p + o - 1 for _, p, o in TRACE)
    assert sum(s["samples"] for s in steps) == sum(o for _, _, o in TRACE)
    assert max(s["tokens"] for s in steps) <= 16
    assert all(s["done_s"] >= s["submitted_s"] >= 0 for s in steps)
    assert all(s["decodes"] + s["prefill_chunks"] == s["requests"] for s in steps)


def test_the_table_shows_each_figure(served, capsys):
    run, _, _ = served
    capsys.readouterr()
    assert main(["report", str(run / "requests.jsonl")]) == 0  # the requests file names its run too
    out = capsys.readouterr().out
    for label in ("TTFT p50", "TPOT p90", "output tokens/s", "measured steps"):
        assert label in out


@pytest.mark.parametrize("file,text,expected", [
    ("serve_run.json", "{not json", "serve_run.json='unreadable': not the JSON"),
    ("serve_run.json", json.dumps({"layout": {}}), "serve_run.json='prediction/layout': missing"),
    ("requests.jsonl", json.dumps({"arrival_s": 0, "prompt_tokens": 3}) + "\n",
     "requests.jsonl:1='output_tokens,ttft_s,tpot_s,total_s': missing"),
    ("requests.jsonl", json.dumps({"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 2, "ttft_s": "soon",
                                   "tpot_s": 0.1, "total_s": 1}) + "\n", "ttft_s"),
])
def test_a_bad_serving_run_file_is_one_line_and_exit_2(served, tmp_path, capsys, file, text, expected):
    run, _, _ = served
    copy = tmp_path / "run"
    copy.mkdir()
    for name in ("serve_run.json", "requests.jsonl", "steps.jsonl"):
        (copy / name).write_text((run / name).read_text())
    (copy / file).write_text(text)
    capsys.readouterr()
    assert main(["report", str(copy)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and expected in err, err


@pytest.mark.parametrize("flags,expected", [
    (["--input", "x.jsonl"], "error: --input/--trace='x.jsonl': give exactly one"),
    (["--cluster", "1x1xcpu"], "error: --cluster='1x1xcpu': is the cluster of the prediction --metrics-file records"),
    (["--metrics-file", "RUN/requests.jsonl", "--cluster", "1x1xH100-SXM", "--tp", "2"], "error: --replicas=1: "),
])
def test_bad_trace_flags_are_one_line_and_exit_2(served, tmp_path, capsys, flags, expected):
    _, folder, trace = served
    flags = [str(tmp_path / f) if f.startswith("RUN/") else f for f in flags]
    capsys.readouterr()
    assert main(["generate", "--from-hf", str(folder), "--trace", str(trace), "--output",
                 str(tmp_path / "out.jsonl"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "out.jsonl").exists()


def test_a_replay_of_the_recorded_requests_predicts_what_generate_predicted_at_launch(served, tmp_path, capsys):
    """The same run read as a served one (no prediction recorded): the report replays requests.jsonl through the
    function generate used at launch, so the figures agree (up to the arrivals' round trip through the clock)."""
    run, _, _ = served
    copy = tmp_path / "run"
    copy.mkdir()
    for name in ("requests.jsonl", "steps.jsonl"):
        (copy / name).write_text((run / name).read_text())
    recorded = json.loads((run / "serve_run.json").read_text())
    (copy / "serve_run.json").write_text(json.dumps({**recorded, "verb": "serve", "workload": None,
                                                     "prediction": None}))
    launched, replayed = report_json(run, capsys), report_json(copy, capsys)
    assert launched["verb"] == "generate" and replayed["verb"] == "serve"
    for key in ("ttft_mean_s", "ttft_p90_s", "tpot_mean_s", "tpot_p90_s", "output_tokens_per_s"):
        for source in ("predicted", "simulated"):
            assert replayed[key][source] == pytest.approx(launched[key][source], rel=1e-6), (key, source)
        assert replayed[key]["measured"] == launched[key]["measured"]
