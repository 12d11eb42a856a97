"""Why one plan beats another, in one sentence a person can check against the breakdowns."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fivefold.planner.search import Candidate

GIB = 2**30

FIELDS = ("dp", "tp", "pp", "cp", "ep", "micro_batch", "schedule", "zero", "recompute", "sequence_parallel")
LABELS = {"micro_batch": "micro-batch", "sequence_parallel": "sequence parallel"}

# What a smaller value of each step-time component means, in words.
EFFECTS = {
    "bubble": "shrinks the pipeline bubble",
    "tp_comm": "cuts tensor-parallel communication",
    "dp_comm": "exposes less data-parallel communication",
    "pp_comm": "spends less on pipeline transfers",
    "cp_comm": "cuts context-parallel communication",
    "ep_comm": "cuts expert all-to-all time",
    "recompute": "recomputes less",
    "compute": "runs its kernels more efficiently",
    "host_overhead": "waits less on kernel launches",
    "optimizer": "spends less in the optimizer step",
}


def _value(plan, name: str) -> str:
    value = getattr(plan, name)
    if name == "sequence_parallel":
        return "on" if value else "off"
    if name == "schedule" and plan.virtual_stages > 1:
        return f"{value}(v{plan.virtual_stages})"
    return str(value)


def _seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.2f} s"
    return f"{value * 1e3:.0f} ms" if value >= 0.01 else f"{value * 1e3:.2f} ms"


def explain_difference(best: Candidate, other: Candidate) -> str:
    """E.g. "pp=4 instead of pp=8: shrinks the pipeline bubble (12.0% -> 6.1% of the step) and costs 3.1 GiB
    more per GPU; 7.0% faster overall"."""
    a, b = best.estimate, other.estimate
    differs = [name for name in FIELDS if _value(best.plan, name) != _value(other.plan, name)]
    changes = " ".join(f"{LABELS.get(name, name)}={_value(best.plan, name)}" for name in differs)
    against = " ".join(f"{LABELS.get(name, name)}={_value(other.plan, name)}" for name in differs)
    subject = f"{changes} instead of {against}" if differs else "a different split of the layers"
    gains = sorted(((b.breakdown_s.get(k, 0.0) - a.breakdown_s.get(k, 0.0), k) for k in EFFECTS), reverse=True)
    reasons = []
    for saving, kind in gains[:2]:
        if saving <= 0.001 * b.step_time_s:
            break
        if kind == "bubble":
            detail = f"{b.bubble_fraction:.1%} -> {a.bubble_fraction:.1%} of the step"
        else:
            detail = f"{_seconds(b.breakdown_s[kind])} -> {_seconds(a.breakdown_s[kind])} per step"
        reasons.append(f"{EFFECTS[kind]} ({detail})")
    memory = a.memory.total - b.memory.total
    if abs(memory) >= 0.05 * GIB:
        reasons.append(f"costs {memory / GIB:.1f} GiB more per GPU" if memory > 0
                       else f"saves {-memory / GIB:.1f} GiB per GPU")
    faster = b.step_time_s / a.step_time_s - 1
    if faster >= 0.0005:
        verdict = f"{faster:.1%} faster overall"
    elif faster > -0.0005:
        verdict = "as fast within 0.05%, and simpler"
    else:
        verdict = f"{-faster:.1%} slower but simpler (the planner asks 0.2% per extra moving part)"
    return f"{subject}: " + (" and ".join(reasons) + "; " if reasons else "") + verdict
