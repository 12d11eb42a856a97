"""What a search returns: the ranked candidates (a Plan with its Estimate) and the search's own account;
NoFeasiblePlan when nothing fits. Apart from search.py so explain.py and render.py can name them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fivefold.cost.results import Estimate
from fivefold.errors import FivefoldError
from fivefold.spec.plan import Plan


class NoFeasiblePlan(FivefoldError):
    """No layout fits in device memory; the message says how close the best one came and what to try."""


@dataclass
class Candidate:
    """One ranked plan with its full estimate."""

    plan: Plan
    estimate: Estimate
    simulated_step_time_s: float | None = None  # set by `plan --simulate-top` (planner/rerank.py)


@dataclass
class SearchResult:
    candidates: list[Candidate]  # fastest first; every one fits
    examined: int  # candidate plans considered (costed, or ruled out by a bound or dominance)
    costed: int  # of those, how many were costed in full
    seconds: float  # wall time of the search
    explanation: str = ""  # why the best beats the runner-up
    notes: list[str] = field(default_factory=list)
    placement: list[str] = field(default_factory=list)  # mixed clusters: which group holds what, and why
    diloco: Any = None  # planner/diloco.py DiLoCoChoice: DiLoCo across a cluster's groups, when considered

    @property
    def candidates_per_s(self) -> float:
        return self.examined / self.seconds if self.seconds > 0 else float("inf")
