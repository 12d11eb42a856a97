"""The action orders of every pipeline schedule: they live in cost/schedules.py, because the estimate walks
the same orders for the plans whose critical path it cannot write in closed form (cost/pipeline.py). The
simulator's names for them, kept here."""

from fivefold.cost.schedules import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, SPLIT_BACKWARD,  # noqa: F401
                                     TORCH_SCHEDULE_CLASS, Action, rank_orders, stage_owners)
