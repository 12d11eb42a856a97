"""Runs a Plan with torch.distributed: DeviceMesh, DTensor tensor parallel (+ sequence parallel), FSDP2 /
ZeRO levels, torch.distributed.pipelining schedules, activation checkpointing, and the elastic launcher.

    mesh.py         process group, device and the (pp, dp, cp, tp) DeviceMesh of a plan
    parallelize.py  TP(+SP) -> activation checkpointing -> DP / ZeRO, on one (stage) model
    pipeline.py     stage models cut from the plan's layers per stage, PipelineStage, schedules
    optim.py        AdamW, warmup + cosine, clipping by the global gradient norm
    config.py       RunConfig: the run's flags, checked once (validate) and written back (to_flags)
    train.py        the training loop of one worker (RunConfig -> summary): forward_backward() per step
    elastic_run.py  ElasticRun: loss guard, stragglers, events, checkpoints and rollback of one worker
    knobs.py        test-only fault knobs (slow devices, injected losses, a hang), applied from the worker entry
    checkpointing.py  async save, exact resume, resharding to another plan, initial weights from HF
    metrics.py      the step record (StepMeter), metrics file, progress bar, MFU, peak memory, the summary
    launch.py       pre-launch checks, the run folder, local worker processes (restarts: fivefold.elastic),
                    the torchrun line
    prepare.py      what `fivefold train` settles before workers start (re-plan, checks, resume, run folder)
"""

from fivefold.runtime.config import RunConfig
from fivefold.runtime.launch import check_runnable, launch, torchrun_command
from fivefold.runtime.train import train

__all__ = ["RunConfig", "check_runnable", "launch", "torchrun_command", "train"]
