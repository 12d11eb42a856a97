"""Suite-wide settings. One CPU thread per process: tests start several worker processes on a 2-core
machine, and oversubscribed OpenMP threads make them many times slower (40 training steps: 25 s with
2 threads per process under load, 0.5 s with 1)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")


import pytest  # noqa: E402


class Launches(list):
    """The configs of each launch `fivefold train` asked for (one list per launch); `nprocs` their process counts."""

    def __init__(self) -> None:
        super().__init__()
        self.nprocs: list[int] = []


@pytest.fixture
def launched(monkeypatch) -> Launches:
    """Record what `fivefold train` would launch, without starting a process (a module may define its own)."""
    import fivefold.runtime

    calls = Launches()

    def fake_launch(configs, nproc, max_restarts=0):
        calls.append(list(configs))
        calls.nprocs.append(nproc)
        return [{"fake": True}]

    monkeypatch.setattr(fivefold.runtime, "launch", fake_launch)
    return calls


DP2_REFERENCE = ["train", "--seq-len", "32", "--device", "cpu", "--cluster", "1x2xcpu", "--steps", "8"]


@pytest.fixture(scope="session")
def dp2_reference(tmp_path_factory):
    """An uninterrupted 2-process run (dp2, tiny, seq 32, global batch 8) of 8 steps, saving every 2 steps: the
    losses the fault-tolerance tests (killed worker, shrink and grow, a preempted Slurm job) must get again."""
    from fivefold.cli import main

    folder = tmp_path_factory.mktemp("reference")
    code = main([*DP2_REFERENCE, "--metrics-file", str(folder / "metrics.jsonl"),
                 "--checkpoint-dir", str(folder / "ck"), "--checkpoint-every", "2", "--keep", "4"])
    assert code == 0
    return folder
