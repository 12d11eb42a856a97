"""What `fivefold simulate` writes: trace.json and timeline.png of a simulated step, side by side.

For a big step the two take about as long (the 1T GPT on 3,072 GPUs: ~0.6 s of JSON, ~1 s of picture with
matplotlib's import), so where the OS can fork, a child process writes the trace while this one draws.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

from fivefold.sim.engine import SimResult
from fivefold.sim.timeline import write_timeline_png
from fivefold.sim.trace import write_chrome_trace

FORK_ABOVE = 50_000  # events: below this the trace takes less than a fork saves


def write_outputs(result: SimResult, out_dir: str | Path) -> tuple[Path, Path]:
    """Write out_dir/trace.json and out_dir/timeline.png; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    trace_path, png_path = out_dir / "trace.json", out_dir / "timeline.png"
    child = os.fork() if hasattr(os, "fork") and len(result.events) > FORK_ABOVE else -1
    if child == 0:  # the child writes the trace and leaves without running the parent's exit handlers
        code = 1
        try:
            write_chrome_trace(result, trace_path)
            code = 0
        except BaseException:  # noqa: BLE001 (reported, then the parent raises)
            traceback.print_exc(file=sys.stderr)
        finally:
            os._exit(code)
    if child < 0:
        write_chrome_trace(result, trace_path)
    write_timeline_png(result, png_path)
    if child > 0:
        _, status = os.waitpid(child, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"writing {trace_path} failed (see above)")
    return trace_path, png_path
