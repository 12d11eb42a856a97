"""--memory-window (point 7): a model whose weights exceed what a worker may hold generates the same tokens with
two layers resident (one computing, the next one read from the safetensors files in a background thread), and
the worker's peak resident memory drops by about the weights it no longer holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fivefold
from fivefold.checkpoint.hf import save_hf, spec_from_hf_config
from fivefold.models import build_model

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc (Linux)")]

SRC = str(Path(fivefold.__file__).resolve().parents[1])
CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=1024,
              intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
              max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
# Run `fivefold generate` in a fresh process and print its own peak resident memory (kB) as the last line:
# VmHWM, not getrusage's ru_maxrss, which on Linux keeps the high-water mark of the forked copy of the parent.
CHILD = ("import sys; from fivefold.cli import main; code = main(sys.argv[1:]); "
         "print(next(line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM'))); "
         "sys.exit(code)")


def generate(folder: Path, tmp: Path, *flags: str) -> tuple[list[list[int]], float]:
    out = tmp / f"out{len(flags)}.jsonl"
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-c", CHILD, "generate", "--from-hf", str(folder), "--input",
                             str(tmp / "in.jsonl"), "--output", str(out), "--max-tokens", "4", "--ignore-eos",
                             "--kv-blocks", "16", *flags],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    peak_mib = int(result.stdout.strip().splitlines()[-1]) / 1024
    return [json.loads(line)["completion_ids"] for line in out.read_text().splitlines()], peak_mib


def test_memory_window_keeps_one_layer_resident_with_the_same_tokens(tmp_path):
    spec = spec_from_hf_config(CONFIG)
    generator = torch.Generator().manual_seed(0)
    state = {name: torch.randn(tensor.shape, generator=generator) * (0.5 if "norm" in name else 0.03) + (
        1.0 if "norm" in name else 0.0) for name, tensor in build_model(spec).state_dict().items()}
    save_hf(spec, state, tmp_path / "big")
    weights_mib = sum(t.numel() * 4 for t in state.values()) / 2**20
    layer_mib = sum(t.numel() * 4 for n, t in state.items() if n.startswith("layers.0.")) / 2**20
    del state
    (tmp_path / "in.jsonl").write_text('{"prompt_ids": [5, 6, 7, 8]}\n{"prompt_ids": [9, 10]}\n')
    full_tokens, full_peak = generate(tmp_path / "big", tmp_path)
    window_tokens, window_peak = generate(tmp_path / "big", tmp_path, "--memory-window", "2")
    assert window_tokens == full_tokens and len(full_tokens[0]) == 4
    # 8 layers of ~44 MiB: the windowed worker holds two (the one computing, the next one read) and small parts.
    assert weights_mib > 300 and layer_mib < 50
    print(f"peak RSS: every weight {full_peak:.0f} MiB, --memory-window 2 {window_peak:.0f} MiB; "
          f"weights {weights_mib:.0f} MiB")
    assert full_peak - window_peak > weights_mib - 4 * layer_mib, (full_peak, window_peak, weights_mib)
