"""torchrun as a Slurm job runs it (runtime/slurm.py): torch's own launcher (torch.distributed.run), except that
its SIGTERM is fivefold's: it marks the stop as graceful for the workers before the agent passes the signal on
(runtime/preemption.py), so they end their step and save, and it ends with one line and exit 128 + the signal
instead of a traceback. Under Slurm a SIGTERM is a normal end (a preemption, or the time limit), after which
the job script requeues the job."""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    from fivefold.runtime.preemption import AGENT_SIGNALS, graceful_term_for_workers

    # torchrun reads its flags' defaults from PET_* variables: its agent leaves SIGTERM to the block below.
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", AGENT_SIGNALS)
    try:
        with graceful_term_for_workers():
            torchrun_main(argv)
    except SignalException as exc:
        signum = int(exc.sigval)
        print(f"torchrun: stopped by signal {signum} after its workers ended their step", file=sys.stderr, flush=True)
        return 128 + signum
    return 0


if __name__ == "__main__":
    sys.exit(main())
