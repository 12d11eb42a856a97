"""FP8 training's scaling and casting (runtime/float8.py), checked against hand-computed FP8 GEMMs on CPU
(torch 2.13 runs torch._scaled_mm there), which linears it converts, and its refusals: a device without FP8,
a recipe the runtime does not run, and the flags that need --dtype fp8 or an MoE model."""

from __future__ import annotations

import pytest
import torch

from fivefold.cli import main
from fivefold.errors import SpecError
from fivefold.models import build_model
from fivefold.runtime import float8
from fivefold.runtime.float8 import E4M3, E5M2, Float8Linear, Float8Matmul, convert_to_float8
from fivefold.spec import PRESETS, ModelSpec

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def fp8_round(x: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """x as the FP8 GEMM sees it: x * scale (fp32, as the cast computes it) rounded to the format, divided back
    in float64."""
    scale = scale.float()
    return (x.float() * scale).to(fp8).double() / scale.double()


def assert_fp32_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to fp32 accumulation (the FP8 GEMM sums in fp32, the reference in float64)."""
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())


def inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 64, generator=generator) * 3
    weight = torch.randn(48, 64, generator=generator) * 0.05
    grad = torch.randn(32, 48, generator=generator) * 1e-3
    return x, weight, grad


def through_fp8(x, weight, grad, recipe):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out = Float8Matmul.apply(x, weight, recipe, float8.WHOLE, torch.float32)
    out.backward(grad)
    return out.detach().double(), x.grad.double(), weight.grad.double()


def test_tensorwise_scales_by_the_whole_tensors_amax_and_casts_gradients_to_e5m2():
    x, weight, grad = inputs()
    out, grad_x, grad_w = through_fp8(x, weight, grad, "tensorwise")
    sx, sw, sg = E4M3_MAX / x.abs().max(), E4M3_MAX / weight.abs().max(), E5M2_MAX / grad.abs().max()
    x8, w8, g8 = fp8_round(x, sx, E4M3), fp8_round(weight, sw, E4M3), fp8_round(grad, sg, E5M2)
    assert_fp32_close(out, x8 @ w8.T)
    assert_fp32_close(grad_x, g8 @ w8)
    assert_fp32_close(grad_w, g8.T @ x8)
    # FP8, not fp32: e4m3 keeps 3 mantissa bits, so the GEMM is a few percent off the exact one
    exact = x.double() @ weight.double().T
    assert 1e-3 < ((out - exact).norm() / exact.norm()).item() < 0.08


def test_rowwise_scales_each_row_along_the_contraction_by_a_power_of_two():
    x, weight, grad = inputs(1)
    out, grad_x, grad_w = through_fp8(x, weight, grad, "rowwise")

    def scale(t, dim):
        s = E4M3_MAX / t.abs().amax(dim=dim, keepdim=True)
        return torch.exp2(torch.floor(torch.log2(s)))

    forward = fp8_round(x, scale(x, 1), E4M3) @ fp8_round(weight, scale(weight, 1), E4M3).T
    dgrad = fp8_round(grad, scale(grad, 1), E4M3) @ fp8_round(weight, scale(weight, 0), E4M3)
    wgrad = fp8_round(grad, scale(grad, 0), E4M3).T @ fp8_round(x, scale(x, 0), E4M3)
    assert_fp32_close(out, forward)
    assert_fp32_close(grad_x, dgrad)
    assert_fp32_close(grad_w, wgrad)
    s = float8._scale(x, E4M3, -1, power_of_two=True)
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))


def test_the_largest_value_saturates_to_the_format_maximum_and_zeros_stay_zeros():
    x = torch.tensor([[-3.0, 1.0, 2.5, 0.0]])
    cast = float8._cast(x, float8._scale(x, E4M3), E4M3)
    assert cast.float()[0, 0].item() == -E4M3_MAX and not cast.float().isnan().any()
    zeros = torch.zeros(16, 16)
    out = Float8Matmul.apply(zeros, torch.ones(16, 16), "tensorwise", float8.WHOLE, torch.float32)
    assert torch.equal(out, torch.zeros(16, 16))


def test_float8_linear_keeps_the_linears_parameters_and_gradient_dtypes():
    linear = Float8Linear(64, 48, bias=True)
    x = torch.randn(2, 16, 64, requires_grad=True)
    out = linear(x)
    out.sum().backward()
    assert out.shape == (2, 16, 48) and x.grad.dtype == torch.float32
    assert {name for name, _ in linear.named_parameters()} == {"weight", "bias"}
    assert linear.bias.grad is not None


def test_block_linears_become_fp8_and_the_rest_stays():
    moe = ModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, experts=4, top_k=2, expert_ffn_hidden=64,
                    shared_experts=1, first_dense_layers=1)
    model = build_model(moe)
    swapped = convert_to_float8(model, "rowwise")
    assert swapped == ["layers.0.attention.wq", "layers.0.attention.wk", "layers.0.attention.wv",
                       "layers.0.attention.wo", "layers.0.feed_forward.w1", "layers.0.feed_forward.w2",
                       "layers.0.feed_forward.w3", "layers.1.attention.wq", "layers.1.attention.wk",
                       "layers.1.attention.wv", "layers.1.attention.wo"]
    assert type(model.output) is torch.nn.Linear and type(model.layers["1"].feed_forward.router) is torch.nn.Linear
    assert model.layers["0"].attention.wq.recipe == "rowwise"
    # tp=4 splits wk/wv (2 kv heads x 16 = 32 wide) into 8 columns, which the FP8 GEMM's 16-wide tiles cannot take
    assert "layers.0.attention.wk" not in convert_to_float8(build_model(PRESETS["tiny"]), "tensorwise", tp=4)


def test_devices_without_fp8_are_refused_in_one_line(monkeypatch):
    with pytest.raises(SpecError, match="a CPU has no FP8 matrix units"):
        float8.check_fp8_device("cpu")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(SpecError, match=r"A100-SXM4-80GB \(compute capability 8.0\) has no FP8 tensor cores"):
        float8.check_fp8_device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    float8.check_fp8_device("cuda")  # an H100 passes


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "fp8"], "error: train.dtype='fp8': a CPU has no FP8 matrix units"),
    (["--dtype", "fp8", "--fp8-recipe", "delayed"], "error: --fp8-recipe='delayed': is Transformer Engine's recipe"),
    (["--dtype", "fp8", "--fp8-recipe", "colwise"], "error: --fp8-recipe='colwise': no such FP8 recipe; fivefold's "
                                                    "runtime trains tensorwise or rowwise"),
    (["--fp8-recipe", "rowwise"], "error: --fp8-recipe='rowwise': scales FP8 GEMMs: it needs --dtype fp8"),
    (["--expert-gemm", "grouped"], "error: --expert-gemm='grouped': chooses how MoE experts run; tiny is dense"),
    (["--expert-gemm", "batched"], "error: --expert-gemm='batched': use one of auto, grouped, loop"),
], ids=["cpu", "te-recipe", "no-recipe", "recipe-without-fp8", "dense-expert-gemm", "bad-expert-gemm"])
def test_bad_fp8_and_expert_flags_stop_before_any_worker(argv, message, capsys, tmp_path, launched):
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert main(["train", "--steps", "1", "--nproc", "1", "--metrics-file", str(metrics), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and len(err.splitlines()) == 1, err
    assert not launched and not metrics.parent.exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < float8.FP8_CAPABILITY,
                    reason="needs a CUDA GPU with FP8 tensor cores (sm89+)")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_cuda_fp8_linear_is_close_to_bf16_and_trains(recipe):
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 512, bias=False, device="cuda", dtype=torch.bfloat16)
    fp8 = Float8Linear(256, 512, bias=False, device="cuda", dtype=torch.bfloat16)
    fp8.weight, fp8.recipe = linear.weight, recipe
    x = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    expected, got = linear(x), fp8(x)
    assert got.dtype == torch.bfloat16
    assert ((got - expected).float().norm() / expected.float().norm()).item() < 0.08
    got.float().square().mean().backward()
    assert x.grad.dtype == torch.bfloat16 and fp8.weight.grad is not None and fp8.weight.grad.isfinite().all()
    with torch.autocast("cuda", dtype=torch.bfloat16):  # one GPU: fp32 weights under autocast write bf16
        assert Float8Linear(256, 512, bias=False, device="cuda")(x.float()).dtype == torch.bfloat16
