"""Start the worker processes of a plan on this machine with torch's elastic launcher (the agent
behind torchrun), after checking that the plan can run at all, so a bad plan stops before any process
starts. For several machines, `torchrun_command` prints the equivalent torchrun line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shlex
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

from fivefold.elastic.agent import AgentWatch
from fivefold.elastic.events import LAUNCHER, EventLog
from fivefold.elastic.report import build_report, write_report
from fivefold.elastic.restart import newest_complete
from fivefold.errors import SpecError, require
from fivefold.interrupt import Interrupted, interrupted_line, quiet_sigint_in_worker
from fivefold.local import free_port, threads_per_worker, tune_allocator
from fivefold.runtime.config import RunConfig, check_gpu_dtype
from fivefold.runtime.preemption import AGENT_SIGNALS, graceful_term_for_workers
from fivefold.spec import Plan
from fivefold.spec.plan import SPLIT_BACKWARD

SCHEDULES_NEEDING_STAGES = ("1f1b",)  # torch's Schedule1F1B refuses fewer micro-batches than stages


def check_runnable(plan: Plan, nproc: int, device: str = "cpu", gpus: int = 0, local_nproc: int | None = None) -> None:
    """What the runtime needs beyond a valid plan; raises SpecError (one line) on the first problem.
    `nproc` is the whole world, `local_nproc` the processes on this machine (default: all of them),
    `gpus` the GPUs this machine has."""
    local_nproc = nproc if local_nproc is None else local_nproc
    if device == "cpu":
        check_local_workers(local_nproc, "--nproc")
    if nproc != plan.world_size:
        raise SpecError("--nproc", nproc, f"the plan needs dp*tp*pp*cp = {plan.world_size} processes on "
                        f"{plan.cluster.label} ({plan.describe()}), not {nproc}; give --nproc {plan.world_size}"
                        + layout_for(plan, nproc))
    if local_nproc < nproc:  # several machines: torchrun decides the node of each rank
        slots = plan.cluster.slots()
        for rank, device_index in enumerate(plan.placement):
            require(slots[device_index].node == slots[rank].node, "plan.placement", list(plan.placement)[:16],
                    f"puts rank {rank} on device {device_index} (node {slots[device_index].node}) but torchrun "
                    f"starts rank {rank} on node {slots[rank].node}; across machines the runtime permutes devices "
                    "within a node only")
    if plan.cp > 1 and plan.sequence_parallel:
        local = plan.train.seq_len // plan.cp
        require(local % plan.tp == 0, "plan.sequence_parallel", True,
                f"each cp rank holds seq_len/cp = {local} tokens, which tp={plan.tp} must divide")
    if plan.pp == 1 and plan.zero >= 2 and len(set(plan.replica_micro_batches)) > 1:
        # ZeRO-2/3 reduce-scatter every micro-batch without a pipeline: replicas would issue different numbers
        # of collectives on one communicator, which NCCL pairs in order (a mismatch or a hang).
        raise SpecError("plan.replica_micro_batches", list(plan.replica_micro_batches),
                        f"uneven replicas need one gradient reduction per step; zero={plan.zero} reduces every "
                        "micro-batch; use zero 0 or 1, even micro-batches, or pp > 1")
    if plan.model.is_moe:
        from fivefold.runtime.expert_parallel import check_moe_runnable
        check_moe_runnable(plan)
    if plan.vocab_parallel:
        from fivefold.runtime.vocab_parallel import check_vocab_parallel_runnable
        check_vocab_parallel_runnable(plan)
    m, t = plan.model, plan.train
    if plan.tp > 1:
        require(m.vocab % plan.tp == 0, "plan.tp", plan.tp,
                f"must divide model.vocab={m.vocab} (the embedding and LM head are split by vocabulary)")
        require(not m.tied_embeddings, "model.tied_embeddings", True,
                "tied embeddings cannot be split by tensor parallelism here; use tp=1 or untied embeddings")
        if plan.sequence_parallel:
            require(t.seq_len % plan.tp == 0, "plan.sequence_parallel", True,
                    f"needs tp={plan.tp} to divide train.seq_len={t.seq_len}")
            if m.position == "learned":
                require(m.max_seq_len % plan.tp == 0, "plan.tp", plan.tp,
                        f"must divide model.max_seq_len={m.max_seq_len} (the position table is split over tp)")
    require(plan.model.sliding_window == 0, "model.sliding_window", plan.model.sliding_window, "sliding-window attention is "
            "costed by the planner but not built by fivefold's models; train with sliding_window=0")
    if plan.train.dtype == "fp8":  # FP8 GEMMs need FP8 tensor cores (runtime/float8.py)
        from fivefold.runtime.float8 import check_fp8_device
        check_fp8_device(device)
    if plan.schedule in SPLIT_BACKWARD and plan.pp > 1:
        # Both found by the parity tests on torch 2.13: zero 3 with these schedules gives wrong weight
        # gradients; selective recompute refuses the second (weight) backward over a saved region.
        require(plan.zero != 3, "plan.zero", plan.zero,
                f"{plan.schedule} with zero 3 (FSDP resharding after forward) gives wrong weight gradients "
                "in torch 2.13; use zero 2 or another schedule")
        require(plan.recompute != "selective", "plan.recompute", plan.recompute,
                f"{plan.schedule} runs the weight gradients in a second backward, which selective "
                "recompute does not allow; use recompute full or none")
    if plan.pp > 1:
        require(not m.tied_embeddings, "model.tied_embeddings", True,
                "tied embeddings need the embedding and LM head on one stage; use pp=1 or untied embeddings")
        for dp_rank in range(plan.dp):
            micro = plan.micro_batches_of_replica(dp_rank)
            if plan.schedule in SCHEDULES_NEEDING_STAGES:
                require(micro >= plan.num_stages, "plan.micro_batch", plan.micro_batch,
                        f"{plan.schedule} needs at least {plan.num_stages} micro-batches per replica "
                        f"(one per stage), got {micro}; lower micro_batch or raise global_batch")
            if plan.schedule in ("interleaved-1f1b", "zb-h1"):
                rounds = max(1, micro // plan.pp)
                require(micro % rounds == 0, "plan.micro_batch", plan.micro_batch,
                        f"{plan.schedule} needs micro-batches per replica ({micro}) to be a multiple of "
                        f"{rounds} (rounds of pp={plan.pp})")
    if device == "cuda":
        require(gpus >= local_nproc, "--device", device,
                f"{local_nproc} processes need {local_nproc} GPUs on this machine, found {gpus}; use torchrun "
                f"on several machines or --device cpu")
        check_gpu_dtype(t.dtype)


def check_local_workers(nproc: int, flag: str) -> None:
    """CPU worker processes on this machine: a number far beyond its cores is a typo, refused before a
    process starts (each worker holds a Python interpreter and torch, ~0.3 GiB)."""
    limit = max(64, 8 * (os.cpu_count() or 1))
    require(nproc <= limit, flag, nproc, f"more CPU worker processes than this machine can hold ({os.cpu_count()} "
            f"cores; at most {limit}); describe a bigger cluster for `plan`/`estimate` instead")


def layout_for(plan: Plan, nproc: int) -> str:
    """', or --cluster 1xNxcpu --dp D' when that layout (same tp, pp, cp) is a valid plan for nproc CPU workers."""
    inner = plan.tp * plan.pp * plan.cp
    if nproc < 1 or nproc % inner:
        return ""
    try:
        from fivefold.spec import parse_cluster

        plan.replace(cluster=parse_cluster(f"1x{nproc}xcpu"), dp=nproc // inner, placement=(),
                     replica_micro_batches=())
    except SpecError:
        return ""
    return f", or --cluster 1x{nproc}xcpu --dp {nproc // inner} for {nproc} CPU workers"


def resolve_device(kind: str) -> tuple[str, int]:
    """("cpu" | "cuda", GPUs on this machine) for --device cpu|cuda|auto."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "auto":
        kind = "cuda" if gpus else "cpu"
    require(kind != "cuda" or gpus > 0, "--device", kind, "no CUDA GPU is visible here; use --device cpu")
    return kind, gpus


def check_data(plan: Plan, data: str | None, tokenizer: str | None, text_field: str = "text",
               flag: str = "--data") -> Any:
    """Open (and for text, tokenize once) the data in the launching process, so workers only map it, and
    check that its token ids fit the model's vocabulary. Nothing is written: the caller writes the token
    caches (data.write_data_caches) once every check of the command has passed. Returns the opened data."""
    from fivefold.data import load_tokenizer, open_data

    tok = load_tokenizer(tokenizer)
    require(tok.vocab_size <= plan.model.vocab, "--tokenizer", tokenizer or "bytes",
            f"has {tok.vocab_size} tokens but model.vocab={plan.model.vocab}; use a larger vocab")
    try:
        dataset = open_data(data, tok, text_field, min_tokens=plan.train.seq_len + 1, write_cache=False)
    except SpecError as exc:  # the same checks for --eval-data, named as such
        if flag == "--data":
            raise
        raise SpecError(exc.field.replace("--data", flag), exc.value, exc.fix) from None
    if plan.train.document_mask:
        from fivefold.data import end_of_document_id
        from fivefold.data.tokenizer import END_OF_DOCUMENT_NAMES

        require(end_of_document_id(dataset, tok) is not None, "--document-mask", True,
                f"the tokenizer {tokenizer} has no end-of-document token (one of {', '.join(END_OF_DOCUMENT_NAMES)}) "
                "to split packed documents at; use a tokenizer that has one, or leave out --document-mask")
    for source in getattr(dataset, "sources", [dataset]):
        if source.vocab_size is not None:
            require(source.vocab_size <= plan.model.vocab, flag, source.name,
                    f"was tokenized with {source.vocab_size} tokens but model.vocab={plan.model.vocab}")
        require(len(source) > plan.train.seq_len, flag, source.name,
                f"has {len(source)} tokens; one sequence needs seq_len + 1 = {plan.train.seq_len + 1}")
        source.check_ids(plan.model.vocab)  # an id past the embedding table fails only inside a worker
    return dataset


def prepare_run_dir(plan: Plan, config: RunConfig, plan_file: str | None,
                    is_rank0: bool = True, fresh: bool = True) -> tuple[str | None, str | None]:
    """The run folder policy: (run folder, plan file for the torchrun line).

    With --metrics-file, its folder is the run folder and keeps the run's plan.toml (for `fivefold report`,
    and as the plan file of the torchrun line when no --plan was given); otherwise --checkpoint-dir is the run
    folder. The run folder gets events.jsonl, pids/ and recovery.json (fivefold.elastic). events.jsonl keeps
    every launch of a run (each starts with a `launch` event: resumes, requeues), so rank 0 clears it only
    when the run starts anew (`fresh`)."""
    run_dir = None
    if config.metrics_file:
        run_dir = Path(config.metrics_file).parent
        if is_rank0:
            run_dir.mkdir(parents=True, exist_ok=True)
            plan.save(run_dir / "plan.toml")
        plan_file = plan_file or str(run_dir / "plan.toml")
    elif config.checkpoint_dir:
        run_dir = Path(config.checkpoint_dir)
    if run_dir is not None and is_rank0 and fresh:
        (run_dir / "events.jsonl").unlink(missing_ok=True)
    return (str(run_dir) if run_dir else None), plan_file


def check_launch_flags(max_restarts: int) -> None:
    """The flags of the launch on this machine (not of the run itself)."""
    require(max_restarts >= 0, "--max-restarts", max_restarts, "must be 0 or more")


class WorkerFailed(Exception):
    """A worker process raised or died; the message is its first error line."""


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than --collective-timeout for a peer."""


@record
def worker_entry(configs: list[RunConfig]) -> list[dict]:
    """What each worker process runs: the configs one after another in one process group (several
    configs amortise process start-up, e.g. for the parity tests); rank 0 returns their summaries."""
    import torch.distributed as dist

    from fivefold.runtime.knobs import FaultKnobs
    from fivefold.runtime.train import train

    quiet_sigint_in_worker()  # a terminal's Ctrl-C reaches every worker too: end without a traceback
    tune_allocator()
    try:
        knobs = FaultKnobs.from_env()  # test-only fault knobs (knobs.py); none set in a real run
        return [train(config, knobs) for config in configs]
    except Interrupted as exc:  # SIGTERM: every rank stopped after a step, its work saved; not a failure
        sys.exit(exc.exit_code)
    except BaseException as exc:  # noqa: BLE001 - recorded for the recovery report, then re-raised
        from fivefold.elastic.events import EventLog, global_rank
        from fivefold.elastic.hang import is_collective_timeout, timeout_message

        rank = global_rank()
        timed_out = is_collective_timeout(exc)
        message = timeout_message(configs[0].collective_timeout, rank) if timed_out else f"{type(exc).__name__}: {exc}"
        EventLog(configs[0].run_dir).write("error", rank=rank, error="timeout" if timed_out else "error",
                                           message=message.strip().splitlines()[0] if message.strip() else "")
        if timed_out:
            raise CollectiveTimeout(message) from None
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch_config_has(field: str) -> bool:
    """Whether torch's LaunchConfig takes `field`: shutdown_timeout (the wait between the workers' SIGTERM and
    SIGKILL, a fixed 30 s before), signals_to_handle (which signals its agent catches)."""
    from torch.distributed.launcher.api import LaunchConfig

    return field in getattr(LaunchConfig, "__dataclass_fields__", {})


def slurm_job() -> dict:
    """The Slurm job this launch runs in (its id and how often it was requeued), {} outside Slurm."""
    if not os.environ.get("SLURM_JOB_ID"):
        return {}
    return {"slurm_job_id": os.environ["SLURM_JOB_ID"],
            "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT") or 0)}


def read_progress(path: str) -> int | None:
    """The last step rank 0 finished (MetricsFile writes it), None before the first one."""
    try:
        return int(Path(path).read_text().strip() or "x")
    except (OSError, ValueError):
        return None


def launch(configs: list[RunConfig], nproc: int, max_restarts: int = 0) -> list[dict]:
    """Run `configs` (RunConfig) on `nproc` local worker processes; rank 0's summaries.

    Raises WorkerFailed when a worker fails (after `max_restarts` restarts).
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent logs every start and stop, and repeats a failed worker's traceback (which the worker
    # already printed); the user sees the workers' own output and one line from WorkerFailed.
    debug = bool(os.environ.get("FIVEFOLD_DEBUG"))
    # torch's elastic modules set their own logger levels, so the parents' level alone does not silence them
    # (e.g. "Received 15 death signal, shutting down workers" on Ctrl-C); set every one of them.
    for name in ["torch.distributed.elastic", "torch.distributed.launcher",
                 *(n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic"))]:
        logging.getLogger(name).setLevel(logging.INFO if debug else logging.CRITICAL)
    grace = {"shutdown_timeout": configs[0].term_grace} if launch_config_has("shutdown_timeout") else {}
    if launch_config_has("signals_to_handle"):  # SIGTERM is graceful_term_for_workers' (runtime/preemption.py)
        grace["signals_to_handle"] = AGENT_SIGNALS
    launch_config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, rdzv_backend="c10d",
                                 rdzv_endpoint=f"localhost:{free_port()}", run_id=f"fivefold-{os.getpid()}",
                                 max_restarts=max_restarts, monitor_interval=0.1, start_method="spawn", **grace)
    # Workers inherit this process's environment: share the cores out unless the user chose.
    user_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads_per_worker(nproc))
    run_dir, metrics_file = configs[0].run_dir, configs[0].metrics_file
    events = EventLog(run_dir, restart=LAUNCHER)
    events.write("launch", nproc=nproc, max_restarts=max_restarts, **slurm_job())
    outcome = "failed"
    handle, progress_file = tempfile.mkstemp(prefix="fivefold-progress-")  # rank 0's last finished step
    os.close(handle)
    configs = [dataclasses.replace(config, progress_file=progress_file) for config in configs]
    try:
        with AgentWatch(run_dir) if run_dir else contextlib.nullcontext(), graceful_term_for_workers():
            results = elastic_launch(launch_config, worker_entry)(list(configs))
        outcome = "finished"
    except (SignalException, KeyboardInterrupt) as exc:
        # Ctrl-C / SIGTERM: torch's agent has already stopped every worker (SIGTERM, then SIGKILL after
        # a grace period) before it re-raised the signal as SignalException.
        outcome = "interrupted"
        signum = int(exc.sigval) if isinstance(exc, SignalException) else int(signal.SIGINT)
        config = configs[-1]
        newest = newest_complete(config.checkpoint_dir)
        raise Interrupted(signum, interrupted_line(read_progress(progress_file), config.steps, config.checkpoint_dir,
                                                   newest)) from None
    except ChildFailedError as exc:
        # A crash on one rank makes its peers fail with connection errors; report the cause.
        def secondary(item) -> bool:
            return any(text in str(item[1].message) for text in ("Connection closed by peer", "Connection reset"))
        rank, failure = min(exc.failures.items(), key=lambda item: (secondary(item), item[1].timestamp, item[0]))
        message = failure.message  # the error file's record: {"message": "Type: text", "extraInfo": ...}
        if isinstance(message, dict):
            message = message.get("message", message)
        lines = [line for line in str(message).strip().splitlines() if line.strip()]
        raise WorkerFailed(f"worker rank {rank} failed (exit code {failure.exitcode}): "
                           f"{lines[0] if lines else 'no message'}"
                           + ("" if debug else " (FIVEFOLD_DEBUG=1 shows the traceback)")) from None
    finally:
        Path(progress_file).unlink(missing_ok=True)
        if user_threads is None:
            del os.environ["OMP_NUM_THREADS"]
        events.write("end", outcome=outcome)
        if run_dir:
            write_report(run_dir, metrics_file)
    summaries = results[0]
    if run_dir and summaries:
        summaries[-1]["recovery"] = build_report(run_dir, metrics_file)
    return summaries


def torchrun_command(plan_file: str | None, run_flags: list[str], nnodes: int, nproc_per_node: int,
                     verb: str = "train", max_restarts: int = 0) -> str:
    """The multi-node equivalent: run this on every node (HOST = the first node's address). Each process
    torchrun starts runs `fivefold VERB` itself as one worker, so it parses and checks the same flags
    (`generate` and `serve` have no plan file: their flags are the layout); `--max-restarts` is torchrun's
    own (its agent restarts the workers, which resume from the newest checkpoint)."""
    plan = ["--plan", plan_file] if plan_file else []
    restarts = ["--max-restarts", str(max_restarts)] if max_restarts else []
    args = ["torchrun", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node), *restarts,
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "HOST:29500", "-m", "fivefold", verb,
            "--torchrun-worker", *plan, *run_flags]
    return " ".join(shlex.quote(a) if a != "HOST:29500" else a for a in args)


def torchrun_world(verb: str = "train") -> tuple[int, int, int]:
    """(world size, processes on this node, global rank) as torchrun sets them for a worker."""
    try:
        return (int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])),
                int(os.environ["RANK"]))
    except KeyError:
        raise SpecError("--torchrun-worker", True, f"is set by the printed torchrun line; run `fivefold {verb}` "
                        "without it on one machine") from None


def run_torchrun_worker(config: RunConfig) -> dict | None:
    """Train this rank inside a world torchrun started; rank 0 returns the summary."""
    import torch.distributed as dist

    from fivefold.runtime.knobs import FaultKnobs
    from fivefold.runtime.train import train

    tune_allocator()
    summary = train(config, FaultKnobs.from_env())
    if dist.is_initialized():
        dist.destroy_process_group()
    return summary


def nodes_of(plan: Plan) -> tuple[int, int]:
    """(nodes, processes per node) of the plan's cluster, for the torchrun line."""
    nodes = sum(g.nodes for g in plan.cluster.groups)
    per_node = max(g.gpus_per_node for g in plan.cluster.groups)
    return nodes, per_node

