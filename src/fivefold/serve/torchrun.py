"""`fivefold generate` and `serve` under torchrun (several machines): the line `fivefold generate|serve` prints
starts tp x pp x replicas processes, one world (gloo on CPU, NCCL on GPU). World rank 0 runs the engine (and the
HTTP server) and is also replica 0's rank 0 (stage 0, tp rank 0); the other ranks run the worker loop.

Rank r belongs to replica r // (tp x pp), as stage and tp rank of r % (tp x pp) (stage-major, as WorkerPool
numbers a replica's ranks): torchrun numbers ranks node by node, so a node's ranks are neighbouring tp ranks
first. Each step the engine sends the pickled StepBatch to the other ranks of its replica over gloo (a length,
then the bytes, over a gloo group: CPU tensors beside NCCL too), and the last stage's tp rank 0 sends the
sampled rows' logits back (received on a thread of rank 0's: their count is known when the step is submitted).
A rank that dies breaks its connections: the engine's next send or receive fails, which ends the run with one
line naming the rank (WorkerDied), as a dead worker process does on one machine."""

from __future__ import annotations

import os
import pickle
import queue
import re
import threading
from datetime import timedelta

import torch

from fivefold.errors import require
from fivefold.local import threads_per_worker
from fivefold.serve.batch import StepBatch
from fivefold.serve.source import ModelSource
from fivefold.serve.workers import (START_TIMEOUT_S, RankModel, WorkerDied, WorkerPlace, drain, join_stage_groups,
                                   one_line)
from fivefold.spec.serve import ServeLayout

LENGTH_TAG, BATCH_TAG, LOGITS_TAG = 1, 2, 3  # point-to-point tags (workers.HIDDEN_TAG = 0 between stages)
STOP = 0  # a batch length of 0: the run is over
# A worker rank waits for the next batch as long as the server idles; a dead peer is noticed by its closed
# connection, not by this timeout.
IDLE_TIMEOUT = timedelta(days=365)


def place_of(layout: ServeLayout, rank: int, device: str) -> WorkerPlace:
    replica, local = divmod(rank, layout.tp * layout.pp)
    stage, tp_rank = divmod(local, layout.tp)
    device_index = int(os.environ.get("LOCAL_RANK", "0"))  # torchrun: this process's GPU on its node
    return WorkerPlace(replica, stage, tp_rank, 0, device, device_index, torch.get_num_threads())


def describe(layout: ServeLayout, rank: int) -> str:
    place = place_of(layout, rank, "cpu")
    return f"rank {rank} (replica {place.replica}, stage {place.stage}, tp rank {place.tp_rank})"


class TorchrunWorld:
    """This process's place in the world torchrun started, its process groups and its part of the model."""

    def __init__(self, source: ModelSource, layout: ServeLayout, device: str, memory_window: int) -> None:
        import torch.distributed as dist

        from fivefold.runtime.launch import torchrun_world

        world, _, rank = torchrun_world("generate` or `fivefold serve")
        require(world == layout.devices, "WORLD_SIZE", world, f"the layout needs tp x pp x replicas = "
                f"{layout.devices} processes; start torchrun with --nnodes x --nproc-per-node = {layout.devices}")
        self.layout, self.rank = layout, rank
        self.place = place_of(layout, rank, device)
        if device == "cuda":
            torch.cuda.set_device(self.place.device_index)
        # The world (joining, hops between stages, tp all-reduces) waits at most START_TIMEOUT_S, so a rank whose
        # rank 0 never joins (refused its input, say) ends; batches and logits travel as CPU tensors over a gloo
        # group of their own that waits as long as the server idles.
        dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timedelta(seconds=START_TIMEOUT_S))
        per_replica = layout.tp * layout.pp
        tp_group = join_stage_groups(layout, [r * per_replica for r in range(layout.replicas)],
                                     self.place.replica, self.place.stage)
        self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        if device == "cpu":
            torch.set_num_threads(threads_per_worker(int(os.environ.get("LOCAL_WORLD_SIZE", layout.devices))))
        self.model = RankModel(source, layout, self.place, memory_window, self.place.replica * per_replica,
                               tp_group)
        self.vocab = source.spec.vocab

    def replica_ranks(self, replica: int) -> list[int]:
        first = replica * self.layout.tp * self.layout.pp
        return list(range(first, first + self.layout.tp * self.layout.pp))

    def logits_rank(self, replica: int) -> int:
        return self.replica_ranks(replica)[(self.layout.pp - 1) * self.layout.tp]

    def serve_batches(self) -> None:
        """Ranks other than 0: run each batch rank 0 sends until it says stop."""
        import torch.distributed as dist

        while True:
            length = torch.zeros(1, dtype=torch.long)
            dist.recv(length, src=0, group=self.control, tag=LENGTH_TAG)
            if int(length) == STOP:
                break
            payload = torch.empty(int(length), dtype=torch.uint8)
            dist.recv(payload, src=0, group=self.control, tag=BATCH_TAG)
            batch: StepBatch = pickle.loads(payload.numpy().tobytes())
            out = self.model.step(batch)
            if out is not None:
                dist.send(out.float().cpu().contiguous(), dst=0, group=self.control, tag=LOGITS_TAG)

    def close(self) -> None:
        import torch.distributed as dist

        self.model.runner.close()
        if dist.is_initialized():
            dist.destroy_process_group()


class TorchrunExecutor:
    """Rank 0's executor (the engine's): `submit` sends the batch to its replica's other ranks and computes rank
    0's part when the batch is replica 0's; `poll` hands back the finished steps' logits. The logits of a replica
    whose last stage is another rank arrive on a receiving thread of that replica (gloo's irecv only completes
    in wait(), so it cannot be polled), in step order."""

    def __init__(self, world: TorchrunWorld) -> None:
        self.world = world
        self.results: queue.Queue = queue.Queue()  # (replica, step, logits) or ("error", rank, message)
        self.expected: dict[int, queue.Queue] = {}  # replica -> (step, rows) the receiving thread waits for
        self.threads: list[threading.Thread] = []

    def _failed(self, rank: int, message: str) -> WorkerDied:
        self.close(notify=False)
        # gloo's "[.../pair.cc:553] Connection closed by peer [addr]. This is typically caused by ...": the middle
        message = re.sub(r"\[[^\]]*\.cc:\d+\] ", "", message).split(". This is typically")[0]
        return WorkerDied(f"worker {describe(self.world.layout, rank)} failed: {message}"[:300])

    def _receive(self, replica: int, expected: queue.Queue) -> None:
        import torch.distributed as dist

        source = self.world.logits_rank(replica)
        while True:
            item = expected.get()
            if item is None:
                return
            number, rows = item
            logits = torch.empty(rows, self.world.vocab, dtype=torch.float32)
            try:
                dist.recv(logits, src=source, group=self.world.control, tag=LOGITS_TAG)
            except RuntimeError as exc:
                self.results.put(("error", source, one_line(exc)))
                return
            self.results.put((replica, number, logits))

    def submit(self, batch: StepBatch) -> None:
        import torch.distributed as dist

        world = self.world
        payload = torch.frombuffer(bytearray(pickle.dumps(batch)), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.long)
        for rank in world.replica_ranks(batch.replica):
            if rank == 0:
                continue
            try:
                dist.send(length, dst=rank, group=world.control, tag=LENGTH_TAG)
                dist.send(payload, dst=rank, group=world.control, tag=BATCH_TAG)
            except RuntimeError as exc:
                raise self._failed(rank, one_line(exc)) from None
        if world.logits_rank(batch.replica) != 0:
            if batch.replica not in self.expected:
                self.expected[batch.replica] = queue.Queue()
                thread = threading.Thread(target=self._receive, args=(batch.replica, self.expected[batch.replica]),
                                          name=f"fivefold-logits-{batch.replica}", daemon=True)
                thread.start()
                self.threads.append(thread)
            self.expected[batch.replica].put((batch.number, len(batch.sample_rows)))
        if batch.replica == 0:
            try:
                out = world.model.step(batch)
            except RuntimeError as exc:  # a collective or a hop with a rank that is gone
                raise self._failed(self._peer_of_step(), one_line(exc)) from None
            if out is not None:
                self.results.put((0, batch.number, out.float().cpu()))

    def _peer_of_step(self) -> int:
        """The rank a failed step of rank 0 most likely lost: its next stage, or its first tp peer."""
        return self.world.layout.tp if self.world.layout.pp > 1 else 1

    def poll(self, wait: float) -> list[tuple[int, int, torch.Tensor]]:
        items = drain(self.results, wait)
        for item in items:
            if item[0] == "error":
                raise self._failed(item[1], item[2])
        return items

    def close(self, notify: bool = True) -> None:
        import torch.distributed as dist

        for expected in self.expected.values():
            expected.put(None)
        if notify and dist.is_initialized():
            stop = torch.tensor([STOP], dtype=torch.long)
            for rank in range(1, self.world.layout.devices):
                try:
                    dist.send(stop, dst=rank, group=self.world.control, tag=LENGTH_TAG)
                except RuntimeError:
                    pass  # that rank is gone already
        for thread in self.threads:
            thread.join(timeout=5.0)
        self.world.close()


def torchrun_executor(source: ModelSource, layout: ServeLayout, device: str,
                      memory_window: int) -> TorchrunExecutor | None:
    """Join the world: rank 0 gets the engine's executor; every other rank serves batches until rank 0 stops,
    then gets None (its verb ends, exit 0)."""
    world = TorchrunWorld(source, layout, device, memory_window)
    if world.rank == 0:
        return TorchrunExecutor(world)
    try:
        world.serve_batches()
    finally:
        world.close()
    return None
