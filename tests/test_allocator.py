"""Workers keep the memory they free (local.tune_allocator): a step that frees and rewrites tens of MB takes
no page faults the second time, and a MALLOC_*_ variable the user set is left alone."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")

# One "step" writes 8 blocks of 9 MiB (a step's gathered weights) and frees them; minor page faults per step
# after two warm-up steps.
SCRIPT = """
import json, resource, sys
sys.path.insert(0, {src!r})
from fivefold.local import tune_allocator
applied = tune_allocator() if sys.argv[1] == "tuned" else []
def step():
    blocks = [bytearray(9 << 20) for _ in range(8)]
    del blocks
step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(json.dumps({{"applied": applied, "faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5}}))
"""

glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                           reason="glibc's mallopt only")


def run(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(src=SRC), mode], env={**clean, **env},
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


@glibc
def test_tuned_worker_reuses_freed_memory():
    plain, tuned = run("plain"), run("tuned")
    assert tuned["applied"] == ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"]
    pages = 8 * (9 << 20) // 4096
    assert plain["faults"] > 0.9 * pages  # glibc's defaults give the 72 MiB back and fault it in again
    assert tuned["faults"] < 0.01 * pages


@glibc
def test_user_setting_wins():
    result = run("tuned", MALLOC_MMAP_THRESHOLD_=str(128 << 10))
    assert result["applied"] == ["MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"]
    assert result["faults"] > 0.9 * 8 * (9 << 20) // 4096  # every block mapped and unmapped, as the user asked
