"""ElasticRun: what keeps one worker's run alive and accounted for, behind three calls in the training loop.

    position = elastic.begin_step(step, loader)      # note the step; draw past batches marked bad
    verdict = elastic.judge(loss, grad_norm)         # the loss guard, agreed by every rank
    step = elastic.end_step(record, verdict, position)  # bad-step and straggler lines and events, the
                                                      # checkpoint, a rollback: the step to continue from

It owns the run's event log (RUN/events.jsonl, for the recovery report), the loss guard (elastic/guard.py),
the straggler watch with its forward clock (elastic/stragglers.py) and the checkpointer (save, resume,
rollback to the newest checkpoint).
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import torch.distributed as dist
from torch import nn

from fivefold.elastic.events import EventLog, write_pid
from fivefold.elastic.guard import LossGuard, Verdict
from fivefold.elastic.hang import note_step
from fivefold.elastic.restart import newest_complete
from fivefold.elastic.stragglers import ForwardClock, StragglerWatch, describe_straggler
from fivefold.runtime.checkpointing import Checkpointer, Log
from fivefold.runtime.config import RunConfig
from fivefold.runtime.mesh import Mesh
from fivefold.spec import Plan


def hostnames() -> list[str]:
    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    return names


class ElasticRun:
    def __init__(self, config: RunConfig, plan: Plan, mesh: Mesh, restart: int, log: Log | None,
                 started: float) -> None:
        """Record the start (this rank's pid, rank 0's `start` event); `restart` > 0 after the elastic agent
        restarted the workers."""
        self.config, self.plan, self.mesh, self.log = config, plan, mesh, log
        write_pid(config.run_dir, mesh.rank)
        self.events = EventLog(config.run_dir if mesh.rank == 0 else None, restart)
        self.events.write("start", started=started, resume_from=config.resume_from, world_size=plan.world_size)
        self.forward_clock = ForwardClock(mesh.device)
        self.guard = LossGuard(config.max_loss_spike, config.max_bad_steps)
        self.checkpointer: Checkpointer | None = None
        self.stragglers: StragglerWatch | None = None
        self.unsaved_seconds = 0.0  # rank 0's step seconds since the newest checkpoint (saved or in flight)

    def start(self, parts: dict[int, nn.Module], checkpointer: Checkpointer) -> int:
        """Resume (or load initial weights) through the checkpointer and start watching the stage forwards;
        the number of steps already done."""
        for part in parts.values():
            self.forward_clock.attach(part)
        self.checkpointer = checkpointer
        first_step = checkpointer.start(self.log)  # > 0 when resuming
        config = self.config
        self.events.write("resumed" if config.resume_from else "ready", step=first_step, path=config.resume_from)
        watch = config.straggler_factor > 0 and self.plan.world_size > 1
        self.stragglers = StragglerWatch(config.straggler_factor, config.straggler_patience,
                                         hosts=hostnames() if watch else [])
        return first_step

    def begin_step(self, step: int, loader) -> int:
        """Note `step` for a timeout's error line; draw past the batches the loss guard marked bad. The
        position (samples_seen) of the batch this step trains on."""
        note_step(step)
        while loader.samples_seen in self.guard.bad_positions:
            loader.next_batch()
        return loader.samples_seen

    def judge(self, loss: float, grad_norm: float) -> Verdict:
        """Bad (skip the update) when the global loss or gradient norm is non-finite or a spike. Every rank
        judges the same global values with the same history, so all reach the same verdict without a
        collective of their own (runtime/bookkeeping.py)."""
        return self.guard.judge(loss, grad_norm)

    def wants_per_rank_metrics(self) -> bool:
        """Rank 0's straggler watch is following a slow rank: it needs every step's per-rank times."""
        return self.stragglers is not None and bool(self.stragglers.slow_since)

    def forward_seconds(self) -> float:
        """This step's stage-forward time on this rank (the straggler watch compares ranks by it)."""
        return self.forward_clock.take()

    def end_step(self, record: dict, verdict: Verdict, position: int) -> int:
        """After the step's metrics are written: the guard's bookkeeping, rank 0's lines and events for a bad
        step or a straggler, the checkpoint, and a rollback after too many bad steps. The step to continue
        from (record["step"], or the step of the checkpoint rolled back to)."""
        assert self.checkpointer is not None and self.stragglers is not None, "start() first"
        step = record["step"]
        self.guard.record(verdict, record["loss"], position)
        if self.mesh.rank == 0 and self.log is not None:
            if verdict.bad:
                self.log(f"loss guard: step {step} (batch at sample {position}): {verdict.reason}; update skipped "
                         f"({self.guard.bad_in_a_row} bad in a row, rollback at "
                         f"{self.config.max_bad_steps or 'never'})")
                self.events.write("bad_step", step=step, position=position, reason=verdict.reason)
            # Per-rank times come on the steps that gather them (runtime/bookkeeping.py gathers_metrics).
            for found in self.stragglers.observe(step, list(record.get("forward_time_s_per_rank", []))):
                self.log(describe_straggler(found))
                self.events.write("straggler", step=step, **found)
        self.unsaved_seconds += float(record.get("step_time_s", 0.0))
        if self.checkpointer.step_done(step):
            self.unsaved_seconds = 0.0
        return self.roll_back(step) if self.guard.should_roll_back else step

    def stop_on_term(self, step: int) -> None:
        """After the step in which some rank got SIGTERM (runtime/preemption.py): finish the save in flight, save
        this step when the newest checkpoint is too far behind (rank 0 decides for every rank), note it."""
        from fivefold.runtime.preemption import should_save_on_term, term_line

        assert self.checkpointer is not None, "start() first"
        checkpointer = self.checkpointer
        finished = checkpointer.wait()
        threshold = self.config.term_save_threshold() if checkpointer.saving else None
        decision = [should_save_on_term(step, checkpointer.newest_step, self.unsaved_seconds, threshold)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(decision, src=0)
        newest = checkpointer.newest_step
        if decision[0]:
            checkpointer.save(step)
            checkpointer.wait()
        if self.log is not None:
            self.log(term_line(step, finished, decision[0], newest, self.unsaved_seconds, threshold)
                     if checkpointer.saving else f"SIGTERM: stopping after step {step}; nothing to save (no "
                                                 "--checkpoint-dir)")
        self.events.write("term", step=step, saved=decision[0], finished_save=finished, newest_step=newest,
                          unsaved_seconds=self.unsaved_seconds, threshold=threshold)

    def roll_back(self, step: int) -> int:
        """After too many bad steps in a row: reload the newest checkpoint (every rank the one rank 0 found,
        once the save in flight is committed); the step to continue from. The bad batches stay skipped."""
        checkpointer, guard, log = self.checkpointer, self.guard, self.log
        assert checkpointer is not None
        checkpointer.wait()
        found = [newest_complete(self.config.checkpoint_dir) if self.mesh.rank == 0 else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(found, src=0)
        positions = sorted(guard.pending)
        guard.rolled_back()
        if found[0] is None:
            if log:
                log(f"loss guard: {len(positions)} bad steps in a row up to step {step}, but no checkpoint to roll "
                    "back to (give --checkpoint-dir and --checkpoint-every); the bad batches stay skipped")
            self.events.write("rollback", step=step, to_step=None, positions=positions, reload_s=0.0)
            return step
        started = time.perf_counter()
        to_step = checkpointer.load(Path(found[0]))
        reload_s = time.perf_counter() - started
        if log:
            log(f"loss guard: {len(positions)} bad steps in a row up to step {step}: rolled back to step {to_step} "
                f"({found[0]}, {reload_s:.2f} s); batches at samples {positions} will be skipped")
        self.events.write("rollback", step=step, to_step=to_step, positions=positions, reload_s=reload_s,
                          path=found[0])
        return to_step

    def close(self) -> None:
        """Wait for the last checkpoint to be committed."""
        if self.checkpointer is not None:
            self.checkpointer.close()
