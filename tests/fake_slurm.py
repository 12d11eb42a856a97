"""A stand-in for Slurm on one machine: `sbatch`, `srun` and `scontrol` scripts that run a job's nodes as local
processes, enough to run what `fivefold train --slurm` prints.

    sbatch SCRIPT   reads the script's #SBATCH lines (--nodes, --chdir, --output, --requeue), runs it with bash
                    under SLURM_JOB_ID / SLURM_NNODES / SLURM_JOB_NODELIST (every node is localhost), writes the
                    batch shell's pid to STATE/batch.pid (where Slurm sends --signal=B:TERM), and runs it again
                    with SLURM_RESTART_COUNT + 1 when the job asked `scontrol requeue` and has --requeue;
                    STATE/exit gets the last exit code
    srun CMD...     one CMD per node (SLURM_NODEID, SLURM_PROCID), SIGTERM passed on to each; fails when one fails
    scontrol        `show hostnames LIST` (one per line) and `requeue JOBID` (marks STATE/requeue)

STATE is $FAKE_SLURM_DIR; the job id is $FAKE_SLURM_JOB_ID.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SBATCH = r'''
import os, re, subprocess, sys
from pathlib import Path

script = Path(sys.argv[-1]).resolve()
state = Path(os.environ["FAKE_SLURM_DIR"])
options = {name: value for name, value in re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", script.read_text(), re.M)}
job, nodes = os.environ["FAKE_SLURM_JOB_ID"], int(options.get("nodes") or 1)
folder = options.get("chdir") or os.getcwd()
log = Path(folder) / (options.get("output") or f"slurm-{job}.out").replace("%j", job)
print(f"Submitted batch job {job}", flush=True)
restarts = 0
while True:
    env = {**os.environ, "SLURM_JOB_ID": job, "SLURM_NNODES": str(nodes),
           "SLURM_JOB_NODELIST": ",".join(["localhost"] * nodes), "SLURM_SUBMIT_DIR": folder}
    if restarts:
        env["SLURM_RESTART_COUNT"] = str(restarts)
    with open(log, "a") as out:
        batch = subprocess.Popen(["bash", str(script)], cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT)
        (state / "batch.pid").write_text(f"{batch.pid}\n")
        code = batch.wait()
    if (state / "requeue").exists() and "requeue" in options:
        (state / "requeue").unlink()
        restarts += 1
        continue
    (state / "exit").write_text(f"{code}\n")
    sys.exit(code)
'''

SRUN = r'''
import os, signal, subprocess, sys

command = sys.argv[1:]
while command and command[0].startswith("--"):
    command.pop(0)
tasks = [subprocess.Popen(command, env={**os.environ, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node),
                                        "SLURM_LOCALID": "0"})
         for node in range(int(os.environ["SLURM_NNODES"]))]

def forward(signum, frame):
    for task in tasks:
        if task.poll() is None:
            task.send_signal(signum)

signal.signal(signal.SIGTERM, forward)
codes = [task.wait() for task in tasks]
sys.exit(next((code if code > 0 else 128 - code for code in codes if code), 0))
'''

SCONTROL = r'''
import os, sys
from pathlib import Path

if sys.argv[1:3] == ["show", "hostnames"]:
    try:
        print("\n".join(sys.argv[3].split(",")), flush=True)
    except BrokenPipeError:  # `| head -n 1` stops reading after the first host
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
elif sys.argv[1] == "requeue":
    (Path(os.environ["FAKE_SLURM_DIR"]) / "requeue").write_text(sys.argv[2] + "\n")
else:
    sys.exit(f"fake scontrol: {sys.argv[1:]} is not faked")
'''


def install(folder: Path) -> Path:
    """Write sbatch, srun and scontrol into `folder` (run with this Python); the folder, to put first on PATH."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, body in (("sbatch", SBATCH), ("srun", SRUN), ("scontrol", SCONTROL)):
        path = folder / name
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(0o755)
    return folder


def environment(bin_folder: Path, state: Path, job_id: int) -> dict[str, str]:
    """The environment of a fake cluster: its commands first on PATH, its state folder and job id."""
    state.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "PATH": f"{bin_folder}{os.pathsep}{os.environ.get('PATH', '')}",
            "FAKE_SLURM_DIR": str(state), "FAKE_SLURM_JOB_ID": str(job_id)}
