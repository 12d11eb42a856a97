"""`fivefold train --wandb PROJECT`: rank 0 logs each step's scalars to Weights & Biases, the same tags and
values TensorBoard gets (runtime/tensorboard.py step_scalars), against the step number.

The W&B run is the fivefold run: its id is kept in RUN/wandb-run-id, so a resumed or requeued run continues the
same W&B run (`resume="allow"`), and its files go to RUN/wandb/. Steps are logged against a metric of their own
(`train/step`) rather than W&B's internal step, which must only grow: a run resumed from step 6 after logging
step 8 logs steps 7 and 8 again. Offline mode (files to upload later with `wandb sync RUN/wandb/offline-run-*`)
when WANDB_MODE says so, or when there is no API key or no connection to W&B; the package is the optional
`tracking` extra.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from fivefold.report.load import WANDB_ID_FILE
from fivefold.runtime.tensorboard import step_scalars

STEP_METRIC = "train/step"
PROBE_TIMEOUT_S = 2.0  # how long the connection check waits for W&B's server


def wandb_mode() -> str:
    """WANDB_MODE when set; else online when an API key is at hand and W&B's server answers, offline otherwise."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    netrc = Path.home() / ".netrc"
    has_key = bool(os.environ.get("WANDB_API_KEY")) or (netrc.is_file() and "api.wandb.ai" in netrc.read_text())
    if not has_key:
        return "offline"
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    try:
        with socket.create_connection((url.hostname or "api.wandb.ai", url.port or 443), timeout=PROBE_TIMEOUT_S):
            return "online"
    except OSError:
        return "offline"


def run_id(run_dir: Path) -> str:
    """This run's W&B id: kept in RUN/wandb-run-id from its first launch on."""
    file = run_dir / WANDB_ID_FILE
    if file.is_file() and file.read_text().strip():
        return file.read_text().strip()
    new = secrets.token_hex(4)
    file.write_text(new + "\n")
    return new


class WandbWriter:
    """One W&B run for the fivefold run in `run_dir`; write() per step, close() at the end."""

    def __init__(self, project: str, run_dir: str | None, config: Any) -> None:
        import wandb  # the optional `tracking` extra: checked before launch (spec/job.py check_wandb_project)

        folder = Path(run_dir or ".")
        folder.mkdir(parents=True, exist_ok=True)
        entity, _, name = project.rpartition("/")
        settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in config.DERIVED}
        self.mode = wandb_mode()
        self.run = wandb.init(project=name, entity=entity or None, dir=str(folder), id=run_id(folder),
                              resume="allow", mode=self.mode, name=folder.resolve().name, config=settings,
                              settings=wandb.Settings(silent=True))  # describe() says where it went
        self.run.define_metric(STEP_METRIC)
        self.run.define_metric("*", step_metric=STEP_METRIC)

    def describe(self) -> str:
        """One line for the run's log: which W&B run, and how to upload it when offline."""
        if self.mode == "offline":
            return (f"W&B: offline run {self.run.id} in {self.run.dir.removesuffix('/files')}; upload it with "
                    f"`wandb sync {Path(self.run.dir).parent}`")
        return f"W&B: run {self.run.id} of project {self.run.project} ({self.mode}): {self.run.url or ''}"

    def write(self, record: dict[str, Any]) -> None:
        self.run.log({STEP_METRIC: int(record["step"]), **step_scalars(record)})

    def close(self) -> None:
        self.run.finish()
