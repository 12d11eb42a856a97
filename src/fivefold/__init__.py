"""fivefold: plan, predict and run hybrid-parallel transformer training."""

__version__ = "0.1.0"
