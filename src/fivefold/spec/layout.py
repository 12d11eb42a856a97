"""A Plan from a partial layout: the defaults of every degree and option the user left out.

`estimate`, `simulate` and `train` take the layout as flags (or a plan file); what is not given follows
the rules here, the one place they are written down. (The planner searches over what is left out instead.)
"""

from __future__ import annotations

from fivefold.errors import SpecError
from fivefold.spec.cluster import ClusterSpec
from fivefold.spec.model import ModelSpec
from fivefold.spec.plan import Plan
from fivefold.spec.train import TrainSpec


def parse_layers_per_stage(text: str | None, flag: str = "--layers-per-stage") -> tuple[int, ...] | None:
    """'3,5' -> (3, 5); None or '' -> None."""
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise SpecError(flag, text, "write integers separated by commas") from None


def layout_plan(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, *, dp: int | None = None,
                tp: int | None = None, pp: int | None = None, cp: int | None = None, cp_method: str | None = None,
                ep: int | None = None, etp: int | None = None,
                zero: int | None = None, micro_batch: int | None = None, schedule: str | None = None,
                virtual_stages: int | None = None, layers_per_stage: tuple[int, ...] | None = None,
                recompute: str | None = None, sequence_parallel: bool | None = None,
                vocab_parallel: bool | None = None) -> Plan:
    """The Plan these choices describe: tp, pp, cp, ep 1; dp the rest of the cluster; zero 0; micro-batch 1;
    1F1B (zbv: 2 virtual stages); even layers; no recompute; sequence parallel when tp > 1; all-gather CP;
    etp 1 (experts whole); no vocabulary parallelism."""
    for flag, value in (("--tp", tp), ("--pp", pp), ("--cp", cp), ("--ep", ep), ("--etp", etp),
                        ("--micro-batch", micro_batch),
                        ("--virtual-stages", virtual_stages)):
        if value is not None and value < 1:  # never a silent 0 -> 1
            raise SpecError(flag, value, "must be at least 1")
    tp, pp, cp, ep = tp or 1, pp or 1, cp or 1, ep or 1
    if dp is None:
        inner = tp * pp * cp
        if cluster.world_size % inner:
            raise SpecError("--tp*--pp*--cp", inner, f"must divide the cluster's {cluster.world_size} devices")
        dp = cluster.world_size // inner
    schedule = schedule or "1f1b"
    virtual = virtual_stages or (2 if schedule == "zbv" else 1)
    return Plan(model=model, cluster=cluster, train=train, dp=dp, tp=tp, pp=pp, cp=cp,
                cp_method=cp_method or "allgather", ep=ep, etp=etp or 1, zero=zero or 0,
                micro_batch=micro_batch or 1, schedule=schedule, virtual_stages=virtual,
                layers_per_stage=layers_per_stage or (), recompute=recompute or "none",
                sequence_parallel=sequence_parallel if sequence_parallel is not None else tp > 1,
                vocab_parallel=bool(vocab_parallel))
