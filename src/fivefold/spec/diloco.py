"""DiLoCo and Streaming DiLoCo: which data-parallel replicas form the outer groups, and when each fragment syncs.

Torch-free, shared by the runtime (runtime/diloco.py), the run checks (runtime/config.py) and the cost model.

Outer groups: the dp dimension of size `dp` is cut into `groups` blocks of dp/groups consecutive replicas;
block g is outer replica g (its own AdamW, its own inner gradient reduction). By default the blocks are the
cluster's `+` groups when the dp replicas fall into them block by block (the dp traffic is what crosses the
slowest link); on a cluster without such groups the default is 2 when dp is even (--diloco-groups sets any
divisor of dp, 1 included).

Schedule (Streaming DiLoCo, Douillard et al. 2025): the parameters are cut into `fragments` pieces; fragment
p starts its exchange after step s (1-based) when s % H == fragment_offset(p) and applies it `overlap` steps
later. With one fragment and no overlap it is plain DiLoCo (Douillard et al. 2023): sync after every H steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from fivefold.errors import SpecError, require
from fivefold.spec.plan import Plan

OUTER_DTYPES = {"fp32": 4, "bf16": 2}  # bytes per element of the exchanged outer gradient
# The flags of `train` and `estimate` (RunConfig fields of the same names) and their defaults.
DILOCO_DEFAULTS: dict[str, Any] = {"dp_sync": "sync", "sync_every": 50, "outer_lr": 0.7, "outer_momentum": 0.9,
                                   "fragments": 1, "overlap": 0, "outer_dtype": "fp32", "diloco_groups": 0}
DILOCO_FLAGS = tuple(DILOCO_DEFAULTS)
MAX_OUTER_LR = 10.0


@dataclass(frozen=True)
class DiLoCoSpec:
    """The outer loop of a DiLoCo run (the `train` flags of the same names)."""

    groups: int  # outer replicas (blocks of the dp dimension)
    sync_every: int  # H: inner steps between two syncs of one fragment
    outer_lr: float = 0.7
    outer_momentum: float = 0.9  # Nesterov
    fragments: int = 1  # P: Streaming DiLoCo's fragments (1 = plain DiLoCo)
    overlap: int = 0  # T: steps between a fragment's send and its apply
    outer_dtype: str = "fp32"

    @property
    def outer_bytes_per_element(self) -> int:
        return OUTER_DTYPES[self.outer_dtype]


def fragment_offset(fragment: int, sync_every: int, fragments: int) -> int:
    """The step residue (mod H) after which fragment `fragment` starts its exchange: spread evenly over H,
    the last fragment at H (residue 0), so one fragment with overlap 0 syncs after steps H, 2H, ..."""
    return ((fragment + 1) * sync_every // fragments) % sync_every


def sends_at(step: int, spec: DiLoCoSpec) -> list[int]:
    """The fragments whose exchange starts after 1-based step `step`."""
    return [p for p in range(spec.fragments)
            if step % spec.sync_every == fragment_offset(p, spec.sync_every, spec.fragments)]


def applies_at(step: int, spec: DiLoCoSpec) -> list[int]:
    """The fragments whose exchange is applied after 1-based step `step` (sent `overlap` steps before)."""
    return sends_at(step - spec.overlap, spec) if step - spec.overlap >= 1 else []


def cluster_groups_of_dp(plan: Plan) -> int:
    """How many of the cluster's `+` groups the dp replicas fall into block by block (replicas
    [g*dp/k, (g+1)*dp/k) all on group g); 1 when they do not (then no link sits between dp blocks)."""
    slots = plan.cluster.slots()
    group_of_replica: dict[int, set[int]] = {}
    for rank in range(plan.world_size):
        group_of_replica.setdefault(plan.coords(rank)["dp"], set()).add(slots[plan.placement[rank]].group)
    if any(len(groups) != 1 for groups in group_of_replica.values()):
        return 1  # some replica spans two groups: the slow link is inside a replica
    order = [next(iter(group_of_replica[d])) for d in range(plan.dp)]
    count = len(set(order))
    if count < 2 or plan.dp % count:
        return 1
    block = plan.dp // count
    blocks = [set(order[g * block:(g + 1) * block]) for g in range(count)]
    return count if all(len(b) == 1 for b in blocks) and len({min(b) for b in blocks}) == count else 1


def outer_groups(plan: Plan, requested: int) -> int:
    """The number of outer replicas of `plan` (`requested` = --diloco-groups, 0 = the default)."""
    if requested:
        require(plan.dp % requested == 0, "--diloco-groups", requested,
                f"must divide the plan's dp={plan.dp} (outer replicas are blocks of dp replicas)")
        return requested
    spanned = cluster_groups_of_dp(plan)
    if spanned > 1:
        return spanned
    if plan.dp % 2 == 0:
        return 2
    raise SpecError("--diloco-groups", 0, f"needs a value: dp={plan.dp} does not split into the cluster's "
                                          "groups or into 2; give a divisor of dp, e.g. --diloco-groups 1")


def diloco_spec(plan: Plan, groups: int, sync_every: int, outer_lr: float, outer_momentum: float,
                fragments: int, overlap: int, outer_dtype: str) -> DiLoCoSpec:
    """The DiLoCo spec of a run of `plan`, with the plan-dependent checks (the flags alone are checked by
    RunConfig.validate)."""
    folded = plan.model.is_moe and (plan.ep > 1 or plan.etp > 1 or plan.tp > 1)
    require(not folded, "--dp-sync", "diloco", f"runs MoE plans only with ep = etp = tp = 1 (the plan has ep={plan.ep}, "
                                               f"etp={plan.etp}, tp={plan.tp}: the experts' data-parallel group would "
                                               "span the outer groups)")
    return DiLoCoSpec(outer_groups(plan, groups), sync_every, outer_lr, outer_momentum, fragments, overlap,
                      outer_dtype)


def check_diloco_flags(flags: Mapping[str, Any]) -> None:
    """--dp-sync and the DiLoCo flags alone (before any plan is known); one SpecError line."""
    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")
    require(flags["dp_sync"] in ("sync", "diloco"), "--dp-sync", flags["dp_sync"], "must be sync or diloco")
    if flags["dp_sync"] == "sync":
        for name, default in DILOCO_DEFAULTS.items():
            require(flags[name] == default, flag(name), flags[name], "needs --dp-sync diloco")
        return
    every, fragments = flags["sync_every"], flags["fragments"]
    require(1 <= every <= 10**6, "--sync-every", every, "must be 1 to 1000000 steps")
    require(math.isfinite(flags["outer_lr"]) and 0 < flags["outer_lr"] <= MAX_OUTER_LR, "--outer-lr",
            flags["outer_lr"], f"must be a positive finite number up to {MAX_OUTER_LR:g}, e.g. 0.7")
    require(math.isfinite(flags["outer_momentum"]) and 0 <= flags["outer_momentum"] < 1, "--outer-momentum",
            flags["outer_momentum"], "must be from 0 to below 1, e.g. 0.9")
    require(1 <= fragments <= every, "--fragments", fragments,
            f"must be 1 to --sync-every ({every}): each fragment syncs on its own step of H")
    require(0 <= flags["overlap"] < max(1, every // fragments), "--overlap", flags["overlap"],
            f"must be 0 to {every // fragments - 1} (below --sync-every / --fragments, so a fragment's exchange "
            "lands before the next one starts)")
    require(flags["outer_dtype"] in OUTER_DTYPES, "--outer-dtype", flags["outer_dtype"], "must be fp32 or bf16")
    require(0 <= flags["diloco_groups"] <= 10**6, "--diloco-groups", flags["diloco_groups"],
            "must be 0 (the default groups) or a divisor of dp")


def spec_from_flags(flags: Mapping[str, Any], plan: Plan) -> DiLoCoSpec | None:
    """The DiLoCo spec the (checked) flags give for `plan`; None with --dp-sync sync."""
    if flags["dp_sync"] != "diloco":
        return None
    return diloco_spec(plan, flags["diloco_groups"], flags["sync_every"], flags["outer_lr"], flags["outer_momentum"],
                       flags["fragments"], flags["overlap"], flags["outer_dtype"])
