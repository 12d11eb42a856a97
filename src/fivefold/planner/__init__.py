"""The planner: enumerate every layout, prune what cannot win, rank the rest by the cost model.

`search(model, cluster, train, choices)` returns the ranked plans that fit, with the reason the best
beats the runner-up; `NoFeasiblePlan` says how close the leanest plan came when none fits. On a mixed
cluster (mixed.py) it also places the ranks (stages or replicas on groups), splits the work by each
device's speed and memory, and explains the placement (SearchResult.placement).
"""

from fivefold.planner.candidates import Candidate, NoFeasiblePlan, SearchResult
from fivefold.planner.search import search
from fivefold.planner.space import Choices, balanced_layers

__all__ = ["Candidate", "Choices", "NoFeasiblePlan", "SearchResult", "balanced_layers", "search"]
