"""Worker processes for every layout but tp1 x pp1 x 1 replica: each replica is its own torch.distributed world of
tp x pp processes (gloo on CPU, NCCL on GPU); the engine (engine.py) stays in the launching process.

The engine puts each step's StepBatch in the inbox of every rank of its replica. Stage s > 0 receives the hidden
states from the same tp rank of stage s - 1 (point to point), computes its layers (one all-reduce over its tp group
after attention and after the MLP), and sends them on; the last stage's tp rank 0 returns the sampled rows' logits.
A stage takes the next batch as soon as it has sent this one on, so pp steps are in flight at once.

Processes are started with multiprocessing (a fork server) rather than torch's elastic agent as `train` is: the engine
must keep talking to its workers (queues) while they live, and elastic_launch only returns when they end."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass

import torch

from fivefold.local import free_port, threads_per_worker
from fivefold.serve.batch import StepBatch
from fivefold.serve.source import ModelSource
from fivefold.spec.serve import ServeLayout

START_TIMEOUT_S = 600.0


class WorkerDied(RuntimeError):
    """A worker process raised or exited; the message is one line naming it."""


@dataclass(frozen=True)
class WorkerPlace:
    replica: int
    stage: int
    tp_rank: int
    port: int
    device: str
    device_index: int
    threads: int

    def rank(self, layout: ServeLayout) -> int:
        return self.stage * layout.tp + self.tp_rank


HIDDEN_TAG = 0  # point-to-point tags: the hidden states between stages (torchrun.py adds its own)


def join_stage_groups(layout: ServeLayout, first_ranks: list[int], replica: int, stage: int):
    """Every replica's tp group of every stage (every rank creates every group, in the same order, as
    torch.distributed requires); this rank's own. first_ranks[r] = the world rank of replica r's rank 0."""
    import torch.distributed as dist

    mine = None
    for r, first in enumerate(first_ranks):
        for s in range(layout.pp):
            group = dist.new_group([first + s * layout.tp + t for t in range(layout.tp)]) if layout.tp > 1 else None
            if (r, s) == (replica, stage):
                mine = group
    return mine


class RankModel:
    """One rank's part of one replica: its stage's layers for its tp rank, and the hops between stages. `step`
    takes the StepBatch, receives the previous stage's hidden states, computes, sends them on, and returns the
    sampled rows' logits on the last stage's tp rank 0 (None on the others). first_rank is the world rank of
    the replica's rank 0 (0 when each replica is its own world, as in WorkerPool)."""

    def __init__(self, source: ModelSource, layout: ServeLayout, place: WorkerPlace, memory_window: int,
                 first_rank: int, tp_group) -> None:
        import torch.distributed as dist

        from fivefold.serve.runner import TORCH_DTYPES, build_runner

        self.layout, self.place, self.hidden = layout, place, source.spec.hidden
        self.dtype = TORCH_DTYPES[layout.dtype]
        self.device = torch.device("cuda", place.device_index) if place.device == "cuda" else torch.device("cpu")
        self.rank = first_rank + place.rank(layout)
        self.runner = build_runner(source, layout, stage=place.stage, tp_rank=place.tp_rank, device=self.device,
                                   memory_window=memory_window,
                                   all_reduce=(lambda t: dist.all_reduce(t, group=tp_group)) if tp_group else None)

    @property
    def returns_logits(self) -> bool:
        return self.place.stage == self.layout.pp - 1 and self.place.tp_rank == 0

    def step(self, batch: StepBatch) -> torch.Tensor | None:
        import torch.distributed as dist

        hidden = None
        if self.place.stage > 0:
            hidden = torch.empty(batch.num_tokens, self.hidden, dtype=self.dtype, device=self.device)
            dist.recv(hidden, src=self.rank - self.layout.tp, tag=HIDDEN_TAG)
        out = self.runner.forward(batch, hidden)
        if self.place.stage < self.layout.pp - 1:
            dist.send(out.contiguous(), dst=self.rank + self.layout.tp, tag=HIDDEN_TAG)
            return None
        return out if self.place.tp_rank == 0 else None


def _worker_main(source: ModelSource, layout: ServeLayout, place: WorkerPlace, memory_window: int, inbox,
                 results) -> None:
    import torch.distributed as dist

    # A terminal's Ctrl-C reaches the whole process group: the engine ends its workers itself (after `serve` has
    # drained its requests), so the workers ignore it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(place.threads)
    rank, world = place.rank(layout), layout.tp * layout.pp
    try:
        if place.device == "cuda":
            torch.cuda.set_device(place.device_index)
        tp_group = None
        if world > 1:
            dist.init_process_group("nccl" if place.device == "cuda" else "gloo", rank=rank, world_size=world,
                                    init_method=f"tcp://127.0.0.1:{place.port}")
            tp_group = join_stage_groups(layout, [0], 0, place.stage)
        model = RankModel(source, layout, place, memory_window, 0, tp_group)
        results.put(("ready", place.replica, rank, None))
        while True:
            batch: StepBatch | None = inbox.get()
            if batch is None:
                break
            out = model.step(batch)
            if out is not None:
                results.put(("logits", place.replica, batch.number, out.cpu().numpy()))
        model.runner.close()
        if world > 1:
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the engine as one line, then the process ends
        results.put(("error", place.replica, rank, one_line(exc)))
        raise SystemExit(1) from None


def one_line(exc: BaseException) -> str:
    """The exception as one line (the traceback too with FIVEFOLD_DEBUG=1)."""
    lines = [line for line in f"{type(exc).__name__}: {exc}".splitlines() if line.strip()]
    if os.environ.get("FIVEFOLD_DEBUG"):
        traceback.print_exc()
    return lines[0] if lines else type(exc).__name__


def drain(results, wait: float) -> list:
    """Every message waiting on `results` (a queue), blocking up to `wait` s for the first."""
    items = []
    try:
        items.append(results.get(timeout=wait))
        while True:
            items.append(results.get_nowait())
    except queue.Empty:
        pass
    return items


class WorkerPool:
    """tp x pp processes per replica; `submit` a StepBatch, `poll` the logits of finished steps."""

    def __init__(self, source: ModelSource, layout: ServeLayout, device: str = "cpu", memory_window: int = 0) -> None:
        # A fork server that has imported torch and this module once forks each worker in milliseconds (a spawned
        # worker imports torch anew, seconds each on a busy machine); it is a fresh process, so no thread of the
        # engine's (the HTTP server's) is forked.
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(["fivefold.serve.workers"])
        self.layout = layout
        self.results = context.Queue()
        self.inboxes: list[list] = []
        self.processes: list[tuple[str, mp.Process]] = []
        per_replica = layout.tp * layout.pp
        threads = threads_per_worker(layout.devices)
        for replica in range(layout.replicas):
            port = free_port()
            inboxes = []
            for rank in range(per_replica):
                stage, tp_rank = divmod(rank, layout.tp)
                place = WorkerPlace(replica, stage, tp_rank, port, device, replica * per_replica + rank, threads)
                inbox = context.Queue()
                process = context.Process(target=_worker_main,
                                          args=(source, layout, place, memory_window, inbox, self.results),
                                          daemon=True, name=f"fivefold-serve-r{replica}-{rank}")
                process.start()
                inboxes.append(inbox)
                self.processes.append((f"replica {replica} rank {rank} (stage {stage}, tp rank {tp_rank})", process))
            self.inboxes.append(inboxes)
        ready = 0
        deadline = time.monotonic() + START_TIMEOUT_S
        while ready < len(self.processes):
            for kind, *_ in self._take(1.0):
                ready += kind == "ready"
            if time.monotonic() > deadline:
                self.close()
                raise WorkerDied(f"the workers did not start within {START_TIMEOUT_S:.0f} s")

    def _take(self, wait: float) -> list[tuple]:
        """Messages from the workers (blocking up to `wait` s for the first); raises WorkerDied on an error or a
        worker that is gone."""
        items = drain(self.results, wait)
        errors = [f"worker replica {replica} rank {rank} failed: {message}"
                  for kind, replica, rank, message in items if kind == "error"]
        if errors or not items:
            if errors:  # a peer's error is often the echo of a worker that died: name the dead one instead
                time.sleep(0.5)
            dead = [(name, process.exitcode) for name, process in self.processes
                    if not process.is_alive() and not (errors and process.exitcode == 1)]
            if dead or errors:
                self.close()
                if dead:
                    name, code = dead[0]
                    raise WorkerDied(f"worker {name} exited (exit code {code})")
                raise WorkerDied(errors[0][:300])
        return items

    def submit(self, batch: StepBatch) -> None:
        for inbox in self.inboxes[batch.replica]:
            inbox.put(batch)

    def poll(self, wait: float) -> list[tuple[int, int, torch.Tensor]]:
        return [(replica, number, torch.from_numpy(logits)) for kind, replica, number, logits in self._take(wait)
                if kind == "logits"]

    def close(self) -> None:
        for inboxes in self.inboxes:
            for inbox in inboxes:
                try:
                    inbox.put(None)
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + 10.0
        for _, process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()
                process.join(timeout=5.0)
        self.inboxes = []
