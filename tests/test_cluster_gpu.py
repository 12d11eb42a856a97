"""The CUDA half of `--profile-steps`: each rank's caching-allocator snapshot beside its trace. Skips without a
GPU (the CPU half runs in tests/test_slurm_job.py)."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from fivefold.cli import main

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_profile_steps_on_cuda_write_a_trace_with_kernels_and_a_memory_snapshot(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--nproc", "1", "--device", "cuda", "--dtype", "bf16", "--seq-len", "64", "--steps", "4",
                 "--profile-steps", "2-3", "--metrics-file", str(run / "metrics.jsonl")]) == 0
    trace = json.loads((run / "profile" / "rank0-steps2-3.trace.json").read_text())
    assert any(event.get("cat") == "kernel" for event in trace["traceEvents"])  # CUDA kernels, not only CPU ops
    snapshot = pickle.loads((run / "profile" / "rank0-steps2-3.memory.pickle").read_bytes())
    assert snapshot["segments"] and any(snapshot["device_traces"])  # allocations recorded over the steps
