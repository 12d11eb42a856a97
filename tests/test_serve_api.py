"""`fivefold serve` end to end with the real `openai` client on loopback: completions and chat equal transformers'
greedy tokens, 16 concurrent streams, seed/stop/usage, HTTP 400 naming the field, 429 on a full queue, KV blocks
freed when clients leave (seen in /metrics), SIGTERM drains and exits 0, a killed worker gives 503 and one line."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import fivefold
from fivefold.local import free_port
from serve_models import hf_greedy, prompts, save_model, save_tokenizer, words

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.slow]

SRC = str(Path(fivefold.__file__).resolve().parents[1])
STEP_DELAY = "0.01"  # a slow model: requests stay in flight long enough to fill the queue or be interrupted


class Server:
    def __init__(self, folder: Path, log: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "FIVEFOLD_SERVE_STEP_DELAY": STEP_DELAY}
        self.process = subprocess.Popen([sys.executable, "-m", "fivefold", "serve", "--from-hf", str(folder),
                                         "--port", str(self.port), *flags], stdout=subprocess.DEVNULL,
                                        stderr=log.open("w"), env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.process.poll() is None, log.read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise AssertionError("the server did not come up: " + log.read_text())

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("api")
    hf_model, path = save_model(folder / "llama")
    save_tokenizer(path)
    return hf_model, path


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("log")
    running = Server(model[1], logs / "server.log", "--max-batch", "4", "--max-queue", "16", "--kv-blocks", "64",
                     "--metrics-file", str(logs / "run" / "requests.jsonl"))
    running.run = logs / "run"
    yield running
    running.stop()


def test_completions_chat_seed_stop_and_models_with_the_openai_client(server, model):
    hf_model, _ = model
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["llama"]
    reference = hf_greedy(hf_model, [5, 6, 7], 10)
    completion = client.completions.create(model="llama", prompt="w5 w6 w7", max_tokens=10, temperature=0)
    assert completion.choices[0].text == words(reference)
    assert completion.usage.prompt_tokens == 3 and completion.usage.completion_tokens == len(reference)
    by_ids = client.completions.create(model="llama", prompt=[5, 6, 7], max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == words(reference)
    chat = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "w9 w10"}],
                                          max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == words(hf_greedy(hf_model, [2, 9, 10, 3], 6))  # the chat template
    sampled = [client.completions.create(model="llama", prompt="w5 w6 w7", max_tokens=10, temperature=1.0,
                                         top_p=0.9, seed=42).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1] and sampled[0] != words(reference)
    stop_word = words(reference[3:4])
    stopped = client.completions.create(model="llama", prompt="w5 w6 w7", max_tokens=10, temperature=0,
                                        stop=[stop_word])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == words(reference[:3]) + " "


def test_sixteen_concurrent_streams_match_their_greedy_tokens(server, model):
    hf_model, _ = model
    client = server.client()
    prompt_ids = prompts(16, seed=9, shortest=2, longest=12)
    before = server.metrics()["fivefold_time_to_first_token_seconds_count"]

    def stream(ids):
        text, finish, usage = "", None, None
        for chunk in client.completions.create(model="llama", prompt=ids, max_tokens=12, temperature=0,
                                               stream=True):
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        return text, finish, usage

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(stream, prompt_ids))
    for ids, (text, finish, usage) in zip(prompt_ids, results):
        expected = hf_greedy(hf_model, ids, 12)
        assert text == words(expected)
        assert finish == ("length" if len(expected) == 12 and 95 not in expected else "stop")
        assert usage.completion_tokens == len(expected)
    after = server.metrics()
    assert after["fivefold_time_to_first_token_seconds_count"] == before + 16
    assert after["fivefold_kv_blocks_in_use"] == 0 and after["fivefold_generation_tokens_total"] > 16 * 2


@pytest.mark.parametrize("body, param", [
    ('{"prompt": "w5", ', "body"),
    ('{"prompt": "w5", "max_tokens": "ten"}', "max_tokens"),
    ('{"prompt": "w5", "max_tokens": 0}', "max_tokens"),
    ('{"prompt": "w5", "temperature": -1}', "temperature"),
    ('{"max_tokens": 3}', "prompt"),
    (json.dumps({"prompt": [5] * 130, "max_tokens": 4}), "prompt"),
    (json.dumps({"prompt": [5] * 100, "max_tokens": 40}), "max_tokens"),
    ('{"prompt": [5, 999]}', "prompt"),
])
def test_bad_requests_get_400_naming_the_field(server, body, param):
    response = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                          timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_openai_client_sees_a_bad_request_error(server):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        server.client().completions.create(model="llama", prompt="w5", max_tokens=0)


def test_full_queue_gets_429_and_leaving_clients_free_their_kv_blocks(server):
    body = {"model": "llama", "prompt": [5, 6, 7, 8], "max_tokens": 100, "temperature": 0, "stream": True}
    statuses = []
    with httpx.Client(timeout=30) as http, contextlib.ExitStack() as streams:
        for _ in range(24):
            response = streams.enter_context(http.stream("POST", server.url + "/v1/completions", json=body))
            statuses.append(response.status_code)
            if response.status_code == 429:
                assert response.read() and json.loads(response.text)["error"]["type"] == "rate_limit_exceeded"
        busy = server.metrics()
        assert busy["fivefold_kv_blocks_in_use"] > 0 and busy["fivefold_requests_running"] == 4
    accepted = statuses.count(200)
    assert 16 <= accepted <= 20 and statuses.count(429) == 24 - accepted  # 4 running + 16 queued at most
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the streams are closed: every request is aborted, its blocks freed
        idle = server.metrics()
        if idle["fivefold_kv_blocks_in_use"] == 0 and idle["fivefold_requests_running"] == 0 and \
                idle["fivefold_requests_queued"] == 0:
            break
        time.sleep(0.2)
    assert idle["fivefold_kv_blocks_in_use"] == 0 and idle["fivefold_requests_queued"] == 0
    assert idle['fivefold_requests_finished_total{reason="abort"}'] >= accepted


def test_sigterm_finishes_the_requests_in_flight_and_exits_0(server):
    client = server.client()
    stream = client.completions.create(model="llama", prompt=[5, 6], max_tokens=40, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    pieces = [next(iter(stream))]
    finished = sum(value for name, value in server.metrics().items()
                   if name.startswith("fivefold_requests_finished_total"))
    server.process.send_signal(signal.SIGTERM)
    pieces += list(stream)
    assert pieces[-1].choices[0].finish_reason in ("length", "stop")
    assert pieces[-1].usage.completion_tokens >= 1
    assert server.process.wait(timeout=60) == 0
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url + "/health", timeout=5)
    # --metrics-file: every request that finished, the one drained after SIGTERM last; closed at the shutdown.
    lines = [json.loads(line) for line in (server.run / "requests.jsonl").read_text().splitlines()]
    assert len(lines) == finished + 1 and lines[-1]["output_tokens"] == pieces[-1].usage.completion_tokens
    assert json.loads((server.run / "serve_run.json").read_text())["cpu_share"]["engine"] > 0
    from fivefold.cli import main

    assert main(["report", str(server.run), "--json"]) == 0


def test_a_dead_worker_fails_pending_requests_with_503_and_the_server_exits(model, tmp_path):
    running = Server(model[1], tmp_path / "server.log", "--tp", "2")
    try:
        workers = httpx.get(running.url + "/health", timeout=10).json()["workers"]
        assert len(workers) == 2
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, running.url + "/v1/completions", timeout=60,
                                  json={"prompt": [5, 6], "max_tokens": 100, "temperature": 0})
            time.sleep(0.5)
            os.kill(workers[1], signal.SIGKILL)
            response = pending.result(timeout=60)
        assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
        assert running.process.wait(timeout=60) == 1
        lines = [line for line in (tmp_path / "server.log").read_text().splitlines() if line.startswith("error")]
        assert len(lines) == 1 and "exited" in lines[0], lines
    finally:
        running.stop()
