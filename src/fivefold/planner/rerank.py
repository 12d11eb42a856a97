"""`plan --simulate-top N`: replay the best N candidates in the simulator and rank them by what it says.

Each candidate is simulated from its own Estimate, so under the software stack the search costed it with
(the stack decides which collectives overlap and how pipeline transfers run); the simulator refines the
cost model's pipeline and overlap arithmetic, it does not swap the assumptions.
"""

from __future__ import annotations

from fivefold.errors import require
from fivefold.planner.explain import explain_difference
from fivefold.planner.candidates import SearchResult


def rerank_by_simulation(result: SearchResult, n: int) -> None:
    """Simulate the first `n` candidates (setting Candidate.simulated_step_time_s) and put them first in
    order of simulated step time; the explanation then compares the new #1 with the new #2."""
    require(n >= 0, "--simulate-top", n, "must be >= 0")
    if n == 0:
        return
    from fivefold.sim.from_plan import simulate_plan

    top = result.candidates[:n]
    for candidate in top:
        candidate.simulated_step_time_s = simulate_plan(candidate.plan, estimate=candidate.estimate).step_time_s
    top.sort(key=lambda candidate: candidate.simulated_step_time_s or 0.0)
    result.candidates = top + result.candidates[n:]
    if len(result.candidates) > 1:
        result.explanation = explain_difference(result.candidates[0], result.candidates[1])
