"""The planner: enumerate every layout, prune what cannot win, rank the rest by the cost model.

`search(model, cluster, train, choices)` returns the ranked plans that fit, with the reason the best
beats the runner-up; `NoFeasiblePlan` says how close the leanest plan came when none fits.
"""

from fivefold.planner.search import Candidate, NoFeasiblePlan, SearchResult, search
from fivefold.planner.space import Choices, balanced_layers

__all__ = ["Candidate", "Choices", "NoFeasiblePlan", "SearchResult", "balanced_layers", "search"]
