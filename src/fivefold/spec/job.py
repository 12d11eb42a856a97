"""The values of a training run as a cluster job, checked without torch: `--resume auto`,
`--save-on-term-within`, `--profile-steps`, `--wandb`, and what `--slurm` passes to sbatch (`--time`,
`--partition`, `--account`, `--output`). Each is one SpecError line naming the flag; the parser (flags.py) and
the run's checks (runtime/config.py, runtime/slurm.py) share them.
"""

from __future__ import annotations

import importlib.util
import math
import re

from fivefold.errors import SpecError, require

MAX_TERM_SAVE_S = 1e9  # --save-on-term-within: beyond ~30 years of steps is a typo
SLURM_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")  # Slurm's --time forms
SLURM_NAME = re.compile(r"^[A-Za-z0-9_.+-]{1,128}$")  # partition and account names


def resume_mode(text: str) -> str:
    """--resume's one value: auto (the bare flag means: the newest checkpoint, which must exist)."""
    if text != "auto":
        raise SpecError("--resume", text, "takes no value, or auto (resume when there is a checkpoint, else "
                                          "start fresh)")
    return text


def seconds_or_off(text: str) -> float | str:
    """--save-on-term-within: seconds of steps (a finite number, 0 or more) or off."""
    if str(text).strip().lower() == "off":
        return "off"
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and 0 <= seconds <= MAX_TERM_SAVE_S):
        raise SpecError("--save-on-term-within", text, "give seconds of steps (a number from 0) or off")
    return seconds


def parse_profile_steps(text: str, steps: int) -> tuple[int, int]:
    """'3-5' -> (3, 5), '4' -> (4, 4): the first and last step profiled, within the run's steps."""
    first, sep, last = str(text).strip().partition("-")
    try:
        span = (int(first), int(last) if sep else int(first))
    except ValueError:
        raise SpecError("--profile-steps", text, "give the first and last step profiled, e.g. 3-5 (or one step, "
                                                 "e.g. 4)") from None
    require(1 <= span[0] <= span[1], "--profile-steps", text, "must be A-B with 1 <= A <= B, e.g. 3-5")
    require(span[1] <= steps, "--profile-steps", text, f"ends after the last step ({steps}); profile steps within "
                                                       "--steps")
    return span


def check_wandb_project(project: str) -> None:
    """A W&B project name (ENTITY/PROJECT allowed), and the package to write it with."""
    require(bool(re.fullmatch(r"([A-Za-z0-9_.-]{1,128}/)?[A-Za-z0-9_.-]{1,128}", project)), "--wandb", project,
            "a project name of letters, digits, '.', '_' and '-' (ENTITY/PROJECT also works)")
    require(importlib.util.find_spec("wandb") is not None, "--wandb", project,
            "needs the wandb package: pip install 'fivefold[tracking]' (or pip install wandb)")


def slurm_time_seconds(text: str) -> int:
    """Seconds of a Slurm time limit: MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS,
    DAYS-HOURS:MINUTES, DAYS-HOURS:MINUTES:SECONDS."""
    match = SLURM_TIME.match(str(text).strip())
    if not match:
        raise SpecError("--time", text, "use one of Slurm's forms: MINUTES, MINUTES:SECONDS, HH:MM:SS, DAYS-HH, "
                                        "DAYS-HH:MM, DAYS-HH:MM:SS (e.g. 2-00:00:00)")
    days, first, second, third = match.groups()
    parts = [int(first)] + [int(p) for p in (second, third) if p is not None]
    if days is not None:  # DAYS-HOURS[:MINUTES[:SECONDS]]
        hours, minutes, seconds = (parts + [0, 0])[:3]
        total = ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    elif len(parts) == 1:  # MINUTES
        total = parts[0] * 60
    elif len(parts) == 2:  # MINUTES:SECONDS
        total = parts[0] * 60 + parts[1]
    else:  # HOURS:MINUTES:SECONDS
        total = (parts[0] * 60 + parts[1]) * 60 + parts[2]
    require(total > 0, "--time", text, "must be a positive time limit")
    return total


def check_slurm_flags(time: str | None, partition: str | None, account: str | None, output: str | None,
                      slurm: bool) -> None:
    """sbatch's own flags: given only with --slurm, each in a form sbatch takes."""
    given = {"--time": time, "--partition": partition, "--account": account, "--output": output}
    for flag, value in given.items():
        if value is None:
            continue
        require(slurm, flag, value, "is passed to sbatch: it goes with --slurm")
        if flag == "--time":
            slurm_time_seconds(value)
        elif flag == "--output":
            require(bool(value.strip()) and "\n" not in value and "\0" not in value, flag, value,
                    "a file name for the job's log, e.g. logs/%j.out")
        else:
            require(bool(SLURM_NAME.match(value)), flag, value, f"a Slurm {flag[2:]} name (letters, digits, "
                                                                "'_', '.', '+', '-')")
