"""What a worker does differently when the elastic agent has restarted it, and the guard's rollback:
both continue from the newest complete checkpoint of the run. No torch import."""

from __future__ import annotations

import warnings

from fivefold.checkpoint.layout import CheckpointWarning, newest_checkpoint


def newest_complete(checkpoint_dir: str | None) -> str | None:
    """The newest complete, verified checkpoint under `checkpoint_dir` (None when there is none). A save
    that was cut off by the failure has no COMMIT and is skipped quietly: that is expected here."""
    if not checkpoint_dir:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        newest = newest_checkpoint(checkpoint_dir)
    return str(newest) if newest is not None else None


def resume_point(checkpoint_dir: str | None, resume_from: str | None, restart: int) -> str | None:
    """The checkpoint this incarnation starts from: in a restarted incarnation (restart > 0) the newest
    complete one (the failure may have come after several saves), else the one chosen at launch."""
    if restart > 0:
        return newest_complete(checkpoint_dir) or resume_from
    return resume_from
