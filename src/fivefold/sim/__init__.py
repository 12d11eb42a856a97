"""Simulation of one training step of a plan: per-rank events, timeline, trace and pictures. No torch here.

- `schedules.rank_orders`: the action order of every pipeline schedule (checked against torch).
- `engine.simulate(StepInput) -> SimResult`: the event-driven replay; `simulate_replicas` for replicas that differ.
- `from_plan.simulate_plan(plan)`: the same from a Plan and the cost model.
- `render.simulate_renderables`: the terminal output of `fivefold simulate`.
- `trace.write_chrome_trace`, `timeline.write_timeline_png`: what users look at.
"""

from fivefold.sim.engine import Event, RankResult, SimResult, StageTimes, StepInput, simulate, simulate_replicas
from fivefold.sim.from_plan import from_estimate, parse_stage_times, simulate_plan
from fivefold.sim.schedules import Action, rank_orders, stage_owners
from fivefold.sim.trace import chrome_trace, write_chrome_trace
from fivefold.sim.timeline import write_timeline_png

__all__ = ["Action", "Event", "RankResult", "SimResult", "StageTimes", "StepInput", "chrome_trace",
           "from_estimate", "parse_stage_times", "rank_orders", "simulate", "simulate_plan",
           "simulate_replicas", "stage_owners", "write_chrome_trace", "write_timeline_png"]
