"""Words for a dry run: the per-rank table, the overflow lines, and `plan --dryrun-top N`."""

from __future__ import annotations

from typing import Callable

from fivefold.dryrun.run import GIB, DryRun, DryRunBuildError, RankResult, dry_run
from fivefold.spec import Plan


def size(nbytes: float) -> str:
    """GiB, or MiB below one GiB (the tiny models)."""
    return f"{nbytes / GIB:.2f} GiB" if abs(nbytes) >= GIB else f"{nbytes / 2**20:.2f} MiB"


def rank_line(one: RankResult) -> str:
    """One kind of rank: measured and estimated peaks with the parts and the signed error."""
    m, e = one.measured, one.estimated
    holds = f" +{'+'.join(one.holds)}" if one.holds else ""
    return (f"rank {one.rank} pp {one.pp_stage}{holds}: measured {size(m['peak'])} (params {size(m['params'])}, "
            f"grads {size(m['grads'])}, optimizer {size(m['optimizer'])}, activations {size(m['activations'])}, "
            f"temporaries {size(m['transient'])}); estimated {size(e['peak'])} ({one.error:+.1%}); "
            f"{one.micro_batches} micro-batches, {one.seconds:.1f} s")


def overflow_lines(result: DryRun) -> list[str]:
    """What would fail at launch: each rank whose tensors plus reserved memory exceed its device."""
    return [f"rank {r.rank} (pp stage {r.pp_stage}) overflows its device by {size(r.overflow)}: "
            f"{size(r.measured['peak'])} of tensors + {size(r.reserved)} reserved > {size(r.capacity)}"
            for r in result.ranks if r.overflow > 0]


def summary_line(result: DryRun) -> str:
    worst = max(result.ranks, key=lambda r: r.measured["peak"] + r.reserved - r.capacity)
    verdict = "fits" if result.fits else "DOES NOT FIT"
    return (f"{result.describe}: {verdict} (busiest rank {worst.rank}: {size(worst.measured['peak'])} measured + "
            f"{size(worst.reserved)} reserved of {size(worst.capacity)}); "
            f"{len(result.ranks)} kinds of rank in {result.seconds:.1f} s")


def check_top(plans: list[Plan], device: str | None = None,
              log: Callable[[str], None] | None = None) -> list[dict]:
    """Dry-run each plan (the planner's best first): one JSON-able verdict per plan, build errors included."""
    verdicts = []
    for index, plan in enumerate(plans, 1):
        try:
            result = dry_run(plan, device)
        except DryRunBuildError as exc:
            verdicts.append({"plan": plan.describe(), "builds": False, "fits": False, "error": str(exc)})
            if log:
                log(f"dry run #{index} {plan.describe()}: does not build: {exc}")
            continue
        verdicts.append({**result.to_dict(), "builds": True, "overflows": overflow_lines(result)})
        if log:
            log(f"dry run #{index} " + summary_line(result))
            for line in overflow_lines(result):
                log(f"  {line}")
    return verdicts
