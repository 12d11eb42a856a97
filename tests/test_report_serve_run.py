"""`fivefold serve --metrics-file` records a served run and `fivefold report` reads it: the app runs in this process
(FastAPI's TestClient runs its lifespan: the engine thread starts, and at the end stops and closes the record), each
request's line is on disk when its client has the answer, the prediction is the replay of the recorded requests at
their arrivals (checked against the cost model and simulator called by hand), and bad files or flags are one line,
exit 2. One process, a 2-layer model of hidden 32."""

from __future__ import annotations

import json

import pytest

from fivefold.cli import build_parser, main
from fivefold.report.serving import percentile
from serve_models import save_model

pytest.importorskip("transformers")
testclient = pytest.importorskip("fastapi.testclient")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

REQUESTS = [([5, 6, 7, 8, 9], 6), ([10, 11], 4), ([12, 13, 14, 15, 16, 17, 18, 19, 20], 3)]  # prompt ids, max


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Serve REQUESTS one after another (as `fivefold serve` builds its app), then stop: (run, folder, answers,
    what was on disk before the stop)."""
    from fivefold.serve.api import make_app
    from fivefold.serve.executor import make_executor
    from fivefold.serve.options import layout_from_serve_args
    from fivefold.serve.record import launch_record
    from fivefold.serve.server import serving_state
    from fivefold.serve.source import open_codec, open_source

    tmp = tmp_path_factory.mktemp("served-run")
    _, folder = save_model(tmp / "llama")
    run = tmp / "run"
    args = build_parser().parse_args(["serve", "--from-hf", str(folder), "--metrics-file", str(run / "requests.jsonl"),
                                      "--cluster", "1x1xcpu", "--max-tokens-per-step", "16"])
    source = open_source(args.from_hf, args.checkpoint)
    layout = layout_from_serve_args(args, source.spec)
    launch = launch_record(args, source.spec, layout, "serve")
    executor = make_executor(source, layout)
    state = serving_state(source, layout, open_codec(source), executor, args.max_queue,
                          metrics_file=args.metrics_file, run=launch[0])
    answers, on_disk = [], []
    try:
        with testclient.TestClient(make_app(state)) as client:
            for ids, max_tokens in REQUESTS:
                response = client.post("/v1/completions", json={"prompt": ids, "max_tokens": max_tokens,
                                                                 "temperature": 0})
                assert response.status_code == 200, response.text
                answers.append(response.json())
                on_disk.append(len((run / "requests.jsonl").read_text().splitlines()))
            on_disk.append(json.loads((run / "serve_run.json").read_text()))
    finally:
        executor.close()
    return run, folder, answers, on_disk


def report_json(run, capsys) -> dict:
    capsys.readouterr()
    assert main(["report", str(run), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_each_request_is_on_disk_when_its_client_has_the_answer(served):
    run, _, answers, on_disk = served
    assert on_disk[:3] == [1, 2, 3]
    while_running = on_disk[3]
    assert while_running["verb"] == "serve" and while_running["prediction"] is None
    assert while_running["cpu_share"] is None  # measured over the whole run: written when it ends
    requests = [json.loads(line) for line in (run / "requests.jsonl").read_text().splitlines()]
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in requests] == \
        [(len(ids), answer["usage"]["completion_tokens"]) for (ids, _), answer in zip(REQUESTS, answers)]
    assert [r["finish_reason"] for r in requests] == [answer["choices"][0]["finish_reason"] for answer in answers]
    # The lifespan's shutdown closed the record: the share of a core the engine got (one process, no workers).
    closed = json.loads((run / "serve_run.json").read_text())
    assert 0.0 < closed["cpu_share"]["engine"] <= 1.0 and closed["cpu_share"]["workers"] is None


def test_the_steps_hold_every_token_of_the_requests(served):
    """Every prompt token computed once and every output token but the last fed back (no preemption here)."""
    run, _, answers, _ = served
    steps = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    outputs = [answer["usage"]["completion_tokens"] for answer in answers]
    assert sum(s["tokens"] for s in steps) == sum(len(ids) + n - 1 for (ids, _), n in zip(REQUESTS, outputs))
    assert sum(s["samples"] for s in steps) == sum(outputs)
    assert max(s["tokens"] for s in steps) <= 16
    requests = [json.loads(line) for line in (run / "requests.jsonl").read_text().splitlines()]
    assert min(s["submitted_s"] for s in steps) >= min(r["arrival_s"] for r in requests) >= 0


def test_the_report_replays_the_recorded_requests_at_their_arrivals(served, capsys):
    from fivefold.cost.deployment import place
    from fivefold.cost.serving_estimate import estimate_serving
    from fivefold.sim.serving import simulate_serving
    from fivefold.spec import parse_cluster
    from fivefold.spec.workload import Request, Workload

    run, folder, answers, _ = served
    report = report_json(run, capsys)
    assert report["verb"] == "serve" and report["requests"] == len(REQUESTS) and report["cluster"] == "1x1xcpu"
    requests = [json.loads(line) for line in (run / "requests.jsonl").read_text().splitlines()]
    ttft, tpot = [r["ttft_s"] for r in requests], [r["tpot_s"] for r in requests]
    assert report["ttft_p50_s"]["measured"] == percentile(ttft, 0.5)
    assert report["tpot_mean_s"]["measured"] == pytest.approx(sum(tpot) / len(tpot))
    span = max(r["arrival_s"] + r["total_s"] for r in requests) - min(r["arrival_s"] for r in requests)
    output = sum(answer["usage"]["completion_tokens"] for answer in answers)
    assert report["output_tokens_per_s"]["measured"] == pytest.approx(output / span)
    # The prediction by hand: the recorded requests from the first arrival, on the recorded model and layout.
    first = min(r["arrival_s"] for r in requests)
    trace = tuple(Request(r["arrival_s"] - first, r["prompt_tokens"], r["output_tokens"])
                  for r in sorted(requests, key=lambda r: r["arrival_s"]))
    assert trace[1].arrival_s > trace[0].arrival_s == 0.0  # sent one after another: their own arrivals
    from fivefold.serve.options import layout_from_serve_args
    from fivefold.serve.source import open_source

    args = build_parser().parse_args(["serve", "--from-hf", str(folder), "--max-tokens-per-step", "16"])
    model = open_source(str(folder), None).spec
    layout = layout_from_serve_args(args, model)
    workload = Workload(trace=trace, num_requests=len(trace))
    replicas = place(model, parse_cluster("1x1xcpu"), layout, kv_blocks=layout.limits.kv_blocks)
    estimate = estimate_serving(replicas, layout.limits, workload, layout.pp)
    simulated = simulate_serving(replicas, layout.limits, workload, layout.pp).to_dict()
    assert report["ttft_p90_s"]["predicted"] == estimate.ttft_p90_s
    assert report["tpot_mean_s"]["predicted"] == estimate.tpot_s
    assert report["ttft_p50_s"]["simulated"] == simulated["ttft_s"]["p50"]
    assert report["output_tokens_per_s"]["simulated"] == simulated["output_tokens_per_s"]
    assert any("predicted now for the 3 requests it recorded" in note for note in report["notes"])
    capsys.readouterr()
    assert main(["report", str(run / "requests.jsonl")]) == 0
    out = capsys.readouterr().out
    for label in ("TTFT p90", "TPOT p50", "output tokens/s", "measured steps", "known only afterwards"):
        assert label in out


def _edit_run(run, copy, name: str, change) -> None:
    copy.mkdir()
    for file in ("serve_run.json", "requests.jsonl", "steps.jsonl"):
        (copy / file).write_text((run / file).read_text())
    if name == "serve_run.json":
        (copy / name).write_text(json.dumps(change(json.loads((run / name).read_text()))))
    elif change is None:
        (copy / name).unlink()
    else:
        (copy / name).write_text(change((run / name).read_text()))


def _no_tokens(text: str) -> str:
    return "".join(json.dumps({**json.loads(line), "output_tokens": 0, "ttft_s": None, "tpot_s": None}) + "\n"
                   for line in text.splitlines())


@pytest.mark.parametrize("name,change,expected", [
    ("requests.jsonl", lambda text: "", "requests.jsonl': holds no request"),
    ("requests.jsonl", None, "requests.jsonl': is missing"),
    ("requests.jsonl", _no_tokens, "no recorded request got a token"),
    ("serve_run.json", lambda run: {**run, "layout": {**run["layout"], "tp": "two"}}, "serve.tp='two'"),
    ("serve_run.json", lambda run: {**run, "model": None}, "serve_run.json:model=None: missing"),
    ("serve_run.json", lambda run: {**run, "verb": "train", "prediction": None}, "prediction/layout"),
])
def test_a_bad_served_run_is_one_line_and_exit_2(served, tmp_path, capsys, name, change, expected):
    run, _, _, _ = served
    _edit_run(run, tmp_path / "run", name, change)
    capsys.readouterr()
    assert main(["report", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and expected in err, err


@pytest.mark.parametrize("flags,expected", [
    (["--cluster", "1x1xcpu"], "error: --cluster='1x1xcpu': is the cluster of the prediction --metrics-file records"),
    (["--metrics-file", "RUN/requests.jsonl", "--cluster", "1x1xH100-SXM", "--tp", "2"], "error: --replicas=1: "),
    (["--metrics-file", "RUN"], "is a folder"),
])
def test_bad_record_flags_of_serve_are_one_line_and_exit_2(served, tmp_path, capsys, flags, expected):
    _, folder, _, _ = served
    (tmp_path / "RUN").mkdir()
    flags = [str(tmp_path / f) if f.startswith("RUN") else f for f in flags]
    capsys.readouterr()
    assert main(["serve", "--from-hf", str(folder), "--port", "0", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "RUN" / "requests.jsonl").exists()
