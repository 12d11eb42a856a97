"""`fivefold generate` on several machines: the torchrun line it prints (as `fivefold train` does), run by two
torchrun agents on this machine (`--nnodes 2`, one process each, pp2), writes the greedy tokens of the single
launcher; bad combinations are one line and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fivefold.cli import main
from fivefold.local import free_port
from serve_models import prompts, read_outputs, save_model, write_prompts

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("torchrun") / "llama")


@pytest.mark.parametrize("flags, expected", [
    (["--tp", "2", "--nnodes", "3"], "error: --nnodes=3: must divide the layout's 2 processes (tp x pp x replicas) "
                                     "into equal nodes"),
    (["--nnodes", "0"], "error: --nnodes=0: must divide the layout's 1 processes"),
    (["--pp", "2", "--torchrun-worker"], "error: --torchrun-worker=True: is set by the printed torchrun line; run "
                                         "`fivefold generate` or `fivefold serve` without it on one machine"),
])
def test_bad_several_machine_flags_are_one_line_and_exit_2(llama, tmp_path, capsys, monkeypatch, flags, expected):
    _, folder = llama
    for name in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    write_prompts(tmp_path / "in.jsonl", [[1, 2, 3]])
    code = main(["generate", "--from-hf", str(folder), "--input", str(tmp_path / "in.jsonl"),
                 "--output", str(tmp_path / "out.jsonl"), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(expected), err


@pytest.mark.slow
def test_two_torchrun_agents_generate_the_tokens_of_the_single_launcher(llama, tmp_path, capsys, monkeypatch):
    _, folder = llama
    monkeypatch.chdir(tmp_path)
    write_prompts(tmp_path / "in.jsonl", prompts(6, seed=9, shortest=3, longest=30))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    assert main(["generate", "--from-hf", str(folder), "--input", "in.jsonl", "--output", "one.jsonl", "--pp", "2",
                 "--max-tokens", "12", "--temperature", "0", "--nnodes", "2"]) == 0
    stderr = capsys.readouterr().err
    line = next(x for x in stderr.splitlines() if x.startswith("on several machines, run on each: "))
    command = line.removeprefix("on several machines, run on each: torchrun ")
    assert command == (f"--nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m fivefold "
                       f"generate --torchrun-worker --from-hf {folder} --pp 2 --input in.jsonl --output one.jsonl "
                       f"--max-tokens 12")  # the flags given, but --nnodes and those at their defaults
    command = command.replace("HOST:29500", f"localhost:{free_port()}").replace("one.jsonl", "two.jsonl")
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *command.split()],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
              for _ in range(2)]
    for agent in agents:
        _, err = agent.communicate(timeout=300)
        assert agent.returncode == 0, err[-3000:]
    one, two = read_outputs(tmp_path / "one.jsonl"), read_outputs(tmp_path / "two.jsonl")
    assert [o["completion_ids"] for o in two] == [o["completion_ids"] for o in one]
    assert [len(o["completion_ids"]) for o in one] == [12] * 6  # no end token in these: every token compared
