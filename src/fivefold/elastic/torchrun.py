"""torchrun as a Slurm job runs it (runtime/slurm.py): torch's own launcher (torch.distributed.run), except that
SIGTERM ends it with one line and exit 128 + the signal instead of a traceback. Under Slurm a SIGTERM is a
normal end (a preemption, or the time limit): the workers have ended their step and saved, and the job script
requeues the job."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(argv)
    except SignalException as exc:
        signum = int(exc.sigval)
        print(f"torchrun: stopped by signal {signum} after its workers ended their step", file=sys.stderr, flush=True)
        return 128 + signum
    return 0


if __name__ == "__main__":
    sys.exit(main())
