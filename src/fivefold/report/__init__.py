"""`fivefold report RUN`: what a run's plan predicted (cost model, simulator) next to what the run measured.

    load.py      the run folder: plan.toml, metrics.jsonl, trace.jsonl; warm-up steps left out
    measured.py  a traced step in the simulator's terms: events per pipeline rank, parts of a step
    compare.py   predicted vs measured figures, per-rank memory and step time, largest sources of error
    timeline.py  report-timeline.png: simulated step above the measured one, one time axis
    render.py    the rich tables the CLI prints

No torch here: a report can be made on a laptop from a run's files.
"""

from fivefold.report.compare import Report, build_report, default_stack, report_run
from fivefold.report.load import WARMUP_STEPS, Run, load_run

__all__ = ["WARMUP_STEPS", "Report", "Run", "build_report", "default_stack", "load_run", "report_run"]
