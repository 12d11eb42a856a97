"""MoE experts as grouped GEMMs (models/moe.py): torch._grouped_mm gives the loop's outputs and gradients
(fp32 on CPU, experts without rows included), "auto" picks the loop off CUDA, and on a Hopper GPU the grouped
bf16 path runs and matches the loop (marked gpu)."""

from __future__ import annotations

import pytest
import torch

from fivefold.models.moe import GroupedExperts, expert_gemm_of, grouped_mm_on_cuda, has_grouped_mm
from fivefold.spec import ModelSpec

SWIGLU = ModelSpec(layers=2, hidden=32, heads=4, experts=4, top_k=2, expert_ffn_hidden=48)
GELU = ModelSpec(layers=2, hidden=32, heads=4, experts=4, top_k=2, expert_ffn_hidden=48, mlp="gelu",
                 norm="layernorm", position="learned")


def experts_of(spec: ModelSpec, device: str = "cpu", dtype: torch.dtype = torch.float32) -> GroupedExperts:
    experts = GroupedExperts(spec).to(device=device, dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in experts.parameters():
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.1)
    return experts


def run(experts: GroupedExperts, gemm: str, rows: torch.Tensor, counts: list[int]):
    """Output, input gradient and weight gradients for one choice of kernel."""
    experts.gemm = gemm
    experts.zero_grad(set_to_none=True)
    rows = rows.detach().requires_grad_()
    out = experts(rows, counts)
    weights = torch.linspace(-1, 1, out.numel(), device=out.device, dtype=out.dtype).view_as(out)
    out.backward(weights)
    return out.detach(), rows.grad, [w.grad for w in experts.parameters()], experts.ran


@pytest.mark.skipif(not has_grouped_mm(), reason="this torch has no torch._grouped_mm")
@pytest.mark.parametrize("spec", [SWIGLU, GELU], ids=["swiglu", "gelu"])
@pytest.mark.parametrize("counts", [[3, 0, 7, 2], [0, 0, 12, 0], [0, 0, 0, 0]], ids=["uneven", "collapsed", "empty"])
def test_grouped_mm_equals_the_loop_forward_and_backward(spec, counts):
    experts = experts_of(spec)
    rows = torch.randn(sum(counts), 32, generator=torch.Generator().manual_seed(1))
    loop = run(experts, "loop", rows, counts)
    grouped = run(experts, "grouped", rows, counts)
    assert loop[3] == "loop" and grouped[3] == ("grouped" if sum(counts) else "loop")
    torch.testing.assert_close(grouped[0], loop[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grouped[1], loop[1], rtol=1e-5, atol=1e-6)
    for got, expected in zip(grouped[2], loop[2], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert all(g is not None for g in grouped[2])  # every weight has its gradient, zero where no row went


def test_auto_runs_the_loop_off_cuda_and_in_fp32():
    rows = torch.zeros(4, 32)
    assert expert_gemm_of("auto", rows) == "loop"
    assert expert_gemm_of("auto", rows.to(torch.bfloat16)) == "loop"  # CPU: the loop stays (module docstring)
    assert expert_gemm_of("grouped", rows) == "grouped" and expert_gemm_of("loop", rows) == "loop"


@pytest.mark.gpu
@pytest.mark.skipif(not grouped_mm_on_cuda(), reason="needs a CUDA GPU with torch._grouped_mm (sm90+)")
def test_cuda_grouped_bf16_matches_the_loop():
    experts = experts_of(SWIGLU, "cuda", torch.bfloat16)
    counts = [40, 0, 88, 8]
    rows = torch.randn(sum(counts), 32, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
    assert expert_gemm_of("auto", rows) == "grouped"
    loop, grouped = run(experts, "loop", rows, counts), run(experts, "auto", rows, counts)
    assert grouped[3] == "grouped"
    torch.testing.assert_close(grouped[0].float(), loop[0].float(), rtol=2e-2, atol=2e-2)
    for got, expected in zip(grouped[2], loop[2], strict=True):
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
    with torch.autocast("cuda", dtype=torch.bfloat16):  # fp32 weights and rows under autocast: cast to bf16
        fp32 = experts_of(SWIGLU, "cuda")
        assert expert_gemm_of("auto", rows.float()) == "grouped"
        assert fp32(rows.float(), counts).dtype == torch.bfloat16


def test_grouped_is_refused_where_torch_grouped_mm_cannot_run(monkeypatch):
    """--expert-gemm grouped on CUDA needs sm90+ and bf16; a torch without the op cannot run it anywhere."""
    from fivefold.errors import SpecError
    from fivefold.models import moe
    from fivefold.runtime.expert_parallel import check_expert_gemm
    from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

    plan = Plan(model=PRESETS["tiny-moe"], cluster=parse_cluster("1x1xH100"), train=TrainSpec(seq_len=32))
    monkeypatch.setattr(moe, "grouped_mm_on_cuda", lambda device=None: False)
    with pytest.raises(SpecError, match="needs a GPU of compute capability 9.0 or newer"):
        check_expert_gemm(plan, "grouped", "cuda")
    monkeypatch.setattr(moe, "grouped_mm_on_cuda", lambda device=None: True)
    check_expert_gemm(plan, "grouped", "cuda")
    fp32 = plan.replace(train=TrainSpec(seq_len=32, dtype="fp32"))
    with pytest.raises(SpecError, match="computes in bf16 on CUDA"):
        check_expert_gemm(fp32, "grouped", "cuda")
    check_expert_gemm(fp32, "loop", "cuda")
    monkeypatch.setattr(moe, "has_grouped_mm", lambda: False)
    with pytest.raises(SpecError, match="has no torch._grouped_mm"):
        check_expert_gemm(plan, "grouped", "cpu")
