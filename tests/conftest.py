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
