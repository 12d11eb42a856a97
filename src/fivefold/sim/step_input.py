"""What a simulated training step takes and makes: the stage costs and step shape (StageTimes, StepInput) and
the timeline bars (Event, and the kinds of bar besides the compute passes). Below engine, replay and summary,
which all use them, so none of those imports another for its types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

OPTIMIZER = "optimizer"
SEND_ACTIVATION = "send-activation"
SEND_GRADIENT = "send-gradient"
GRAD_REDUCE = "grad-reduce"
PARAM_GATHER = "param-gather"
EMBEDDING_SYNC = "embedding-sync"
CONTEXT_EXCHANGE = "cp-exchange"  # context parallel's K/V all-gather or Ulysses all-to-alls, lane "cp"
VOCAB_COLLECTIVES = "vocab-collectives"  # vocabulary parallelism's pp-group collectives (cost/vocab.py), lane "cp"
OUTER_SYNC = "outer-sync"  # DiLoCo: a fragment's outer all-reduce between the groups (sim/diloco.py), lane "comm"
INNER_STEPS = "inner-steps"  # DiLoCo: a run of inner steps drawn as one bar (sim/diloco.py), lane "compute"


class Event(NamedTuple):
    """One bar of the timeline (a tuple: hundreds of thousands are made for a big plan)."""

    rank: int  # the row: pp rank, plus replica * pp when replicas that differ are simulated
    lane: str  # "compute", "comm", or "cp" (context-parallel or vocabulary collectives inside a compute pass)
    kind: str  # F, B, I, W, optimizer; send-activation, send-gradient, grad-reduce, param-gather, embedding-sync
    start: float  # seconds from the start of the step
    end: float
    stage: int = -1  # virtual stage, -1 when not tied to one
    micro_batch: int = -1  # micro-batch, -1 when not tied to one
    peer: int = -1  # for sends: the receiving row


@dataclass(frozen=True)
class StageTimes:
    """What one virtual stage costs for one micro-batch (seconds, bytes)."""

    forward: float  # forward compute (+ its exposed tp/cp/ep communication)
    backward_input: float  # input-gradient part of the backward (+ recompute forward, if any)
    backward_weight: float  # weight-gradient part of the backward
    send_activation: float = 0.0  # p2p time of one activation to the next stage (the gradient back: same)
    activation_bytes: float = 0.0  # memory held per in-flight micro-batch
    static_bytes: float = 0.0  # parameters + gradients + optimizer states of this stage
    grad_reduce: float = 0.0  # one data-parallel reduction of this stage's gradients
    reduce_every_micro_batch: bool = False  # ZeRO-2/3: after every backward; else once, after the last
    param_gather: float = 0.0  # one all-gather of this stage's parameters
    reshard_after_forward: bool = False  # weights freed after a forward (ZeRO-3): the next pass gathers
    reshard_after_backward: bool = False  # weights freed after a backward: the next forward gathers
    buckets: int = 1  # layers: gradient buckets / gathered modules that are ready one by one
    cp_forward: float = 0.0  # exposed context-parallel communication inside `forward` (already counted there)
    cp_backward: float = 0.0  # ... inside `backward_input`
    vocab_forward: float = 0.0  # vocabulary-parallel collectives inside `forward` (already counted there)
    vocab_backward: float = 0.0  # ... inside `backward_input`


@dataclass(frozen=True)
class StepInput:
    """Everything the engine needs to replay one step of one pipeline."""

    schedule: str  # gpipe | 1f1b | interleaved-1f1b | zb-h1 | zbv
    pp: int  # pipeline ranks
    virtual_stages: int  # stages per rank
    micro_batches: int  # micro-batches per step
    stages: tuple[StageTimes, ...]  # one per virtual stage, in model order
    optimizer: tuple[float, ...] = ()  # optimizer step seconds per pp rank; () = none
    tied_embedding_sync: float = 0.0  # all-reduce of the tied embedding gradient, first <-> last stage
    rank_base_bytes: tuple[float, ...] = ()  # memory per pp rank besides states and activations
    overlap_grad_reduce: bool = True  # reduce bucket by bucket under the backward; else after it, blocking
    overlap_param_gather: bool = True  # gather layer by layer ahead of compute; else the pass waits for all
    async_p2p: bool = True  # sends run beside compute; else the sender waits until its send is through
    rank_labels: tuple[str, ...] = ()  # how to name each pp rank in pictures; () = "pp0", "pp1", ...
    title: str = ""  # one line naming the plan
