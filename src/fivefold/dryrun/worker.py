"""One rank of a dry run in its own process: `python -m fivefold.dryrun.worker` reads
{"plan_toml", "rank", "gpu"} as JSON on stdin and prints one JSON object on stdout: the accounted peak, or
{"error", "phase"} when the rank does not build or does not step.

Each rank runs in a fresh process because DTensor caches sharding decisions by mesh equality across
process groups, so a second fake world in one process would reuse the first world's groups; a fresh
process also starts with nothing allocated.
"""

from __future__ import annotations

import json
import sys
import tomllib
import warnings


def main() -> int:
    request = json.load(sys.stdin)
    from fivefold.dryrun.rank import measure_rank
    from fivefold.spec import plan_from_dict

    # FSDP2 flags nn.Linear's reshaped outputs as views (runtime/train.py silences it the same way).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed\.pipelining")
    plan = plan_from_dict(tomllib.loads(request["plan_toml"]))
    try:
        accounted = measure_rank(plan, request["rank"], request["gpu"])
    except Exception as exc:  # reported to the parent as one line: the point of a dry run is to catch these
        message = str(exc).strip().splitlines()
        detail = next((line.strip() for line in message if line.strip()), "")
        cause = exc.__cause__
        if cause is not None:  # torch.distributed.pipelining wraps the real error
            detail = f"{detail} ({type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''})"
        json.dump({"error": f"{type(exc).__name__}: {detail}"}, sys.stdout)
        return 0
    json.dump({"peak": accounted.peak, "parts": accounted.parts, "kinds": accounted.kinds,
               "seconds": accounted.seconds, "micro_batches": accounted.micro_batches,
               "cpu_seconds": accounted.cpu_seconds}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
