"""Hung peers: every collective gets a timeout, and a timed-out collective ends the worker with one line.

`--collective-timeout S` becomes the timeout of the default process group AND of every group created
after it (the DeviceMesh's dp/pp/tp groups, the checkpoint group): torch's new_group without a timeout
uses the module default `default_pg_timeout` (30 min; 10 min for NCCL) rather than the world group's,
so that default is set too. With gloo a recv that waits longer raises "Timed out waiting ... ms";
with NCCL the watchdog aborts the communicator after the timeout. The
process group's store is made per restart (attempt_store) so a restarted incarnation never reads the
dead one's keys.

Test-only knob: FIVEFOLD_HANG_AT="RANK:STEP" makes that rank stop participating (sleep forever) at the
start of STEP, in the first incarnation only (a restarted run does not hang again).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

from fivefold.errors import SpecError

HANG_ENV = "FIVEFOLD_HANG_AT"
current_step = 0  # the 1-based step this process is in, for the error line


def hang_point(text: str | None = None) -> tuple[int, int] | None:
    """'1:4' -> (rank 1, step 4); '' -> None."""
    text = os.environ.get(HANG_ENV, "") if text is None else text
    if not text.strip():
        return None
    rank, sep, step = text.partition(":")
    try:
        point = (int(rank), int(step))
    except ValueError:
        point = (-1, -1)
    if not sep or point[0] < 0 or point[1] < 1:
        raise SpecError(HANG_ENV, text, "write RANK:STEP, e.g. 1:4 (rank 1 stops at step 4)")
    return point


def init_distributed_with_timeout(device, seconds: float) -> None:
    """Join this launch's process group with `seconds` as the timeout of every collective."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if dist.is_initialized():
        return
    timeout = timedelta(seconds=seconds)
    c10d.default_pg_timeout = timeout  # read by new_group when no timeout is given (see module docstring)
    if hasattr(c10d, "default_pg_nccl_timeout"):
        c10d.default_pg_nccl_timeout = timeout
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None, timeout=timeout,
                            **attempt_store(timeout))


def attempt_store(timeout: timedelta) -> dict:
    """Under torch's elastic agent, a store whose keys are this restart's own: the agent's TCPStore
    outlives a restart, and the groups created after the default one (DeviceMesh dims, the checkpoint
    group) are keyed by names that repeat in every incarnation, so a restarted worker would read the dead
    incarnation's addresses and fail with "Connection refused" (found on torch 2.13, 2 CPU ranks)."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or "MASTER_ADDR" not in os.environ:
        return {}  # a plain env:// launch
    from torch.distributed import PrefixStore, TCPStore

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
                     is_master=not agent_store and rank == 0, timeout=timeout, multi_tenant=not agent_store)
    return {"store": PrefixStore(f"/fivefold/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store),
            "rank": rank, "world_size": world}


def step_started(step: int, rank: int, restart: int) -> None:
    """Note the step for the error line; the hang knob stops here."""
    global current_step
    current_step = step
    point = hang_point()
    if point is not None and restart == 0 and point == (rank, step):
        while True:
            time.sleep(3600)


def is_collective_timeout(exc: BaseException) -> bool:
    text = str(exc)
    # gloo: "Timed out waiting 5000ms for recv operation to complete"; NCCL's watchdog: "... timed out" /
    # "Watchdog caught collective operation timeout". Not gloo's "timed out connecting" (a dead peer).
    return isinstance(exc, RuntimeError) and ("Timed out waiting" in text or "collective operation timeout" in text)


def timeout_message(seconds: float, rank: int) -> str:
    return (f"collective timed out after {seconds:g} s (--collective-timeout) at step {current_step} on rank {rank}: "
            "a peer rank stopped participating (hung, deadlocked or far slower); raise --collective-timeout "
            "if it was only slow")
