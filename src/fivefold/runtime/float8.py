"""FP8 training of the block linears (`fivefold train --dtype fp8`): FP8 GEMMs through `torch._scaled_mm` with
dynamic scaling, in one small autograd function; BF16 everywhere else.

Why not torchao's float8 training, which TorchTitan uses: torchao 0.18.0 (the newest release) does import with
torch 2.13 here and its `convert_to_float8_training` trains on CPU, but its compiled extension does not load against
this torch (it warns and goes on), and whether the same wheel runs on the GPU image's torch 2.11 cannot be checked
without a GPU; each torchao release is built against one torch, so the project would carry a wheel per image and
a dependency for what is one GEMM call with two scales per tensor. `torch._scaled_mm` is in both torch versions
(on CPU too in 2.13: the tests run the numerics there), so the same recipes are written here over it, and they
compose with fivefold's DTensor tensor parallelism on local shards (below).

Recipes (torchao's names, the same math):
- tensorwise: one scale per tensor from its amax now (dynamic scaling), `scale = fp8_max / amax`; input and weight
  in e4m3, the output gradient in e5m2 (its range); the FP8 copies of input and weight are kept for backward, where
  the dgrad and wgrad GEMMs take them transposed.
- rowwise: a scale per row along each GEMM's contraction dimension, rounded down to a power of two; every operand
  in e4m3; backward casts the saved high-precision input, weight and gradient again along the other axis.
The GEMMs accumulate in fp32 and write the compute dtype (bf16 on a GPU, fp32 on CPU).

Which layers: the attention's q/k/v/o and the dense MLP's w1/w2/w3 of every block whose widths the FP8 GEMM's
16-element tiles divide (after tensor parallelism). Embeddings, the LM head, norms, attention itself, the MoE
router, routed experts (grouped GEMMs) and shared experts stay in BF16, as TorchTitan leaves its output layer and
experts out of Float8 training. A micro-batch whose rows 16 does not divide runs that GEMM in BF16 on CUDA.

Under tensor parallelism the weights (and the layer's input) are DTensors: the GEMMs run on the local shards and
every scale is the one the whole tensor would have (its amax all-reduced with MAX over the tp group where the
scaled dimension is split), so FP8 values, and the loss, match the single-process run up to summation order.
FSDP2 (ZeRO) gathers the weights in BF16 before the cast; the cost model's `fivefold` stack prices it so.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fivefold.errors import SpecError

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
AMAX_FLOOR = 1e-12  # an all-zero tensor scales by fp8_max / this, and casts to zeros
FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with FP8 tensor cores
TILE = 16  # torch._scaled_mm's operands need both dimensions divisible by 16


def check_fp8_device(device: str) -> None:
    """`--dtype fp8` on this machine's devices: GPUs with FP8 tensor cores only, one line otherwise."""
    if device != "cuda":
        raise SpecError("train.dtype", "fp8", "a CPU has no FP8 matrix units; train FP8 on GPUs with FP8 tensor cores "
                        "(H100, H200, B200, L40S, RTX 4090) or use bf16/fp32 here")
    for index in range(torch.cuda.device_count()):
        capability = torch.cuda.get_device_capability(index)
        if capability < FP8_CAPABILITY:
            name = torch.cuda.get_device_name(index)
            raise SpecError("train.dtype", "fp8", f"{name} (compute capability {capability[0]}.{capability[1]}) has "
                            "no FP8 tensor cores; FP8 training needs 8.9 or newer (H100, H200, B200, L40S, RTX 4090); "
                            "train in bf16")


def _amax(x: torch.Tensor, dim: int | None, group: dist.ProcessGroup | None) -> torch.Tensor:
    """max |x| in fp32: over the whole tensor (dim None) or along `dim` (kept); over `group` too when x is a shard."""
    if dim is None:
        found = torch.linalg.vector_norm(x, ord=float("inf")).float()
    else:
        found = torch.linalg.vector_norm(x, ord=float("inf"), dim=dim, keepdim=True).float()
    if group is not None:
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return found


def _scale(x: torch.Tensor, fp8: torch.dtype, dim: int | None = None, group: dist.ProcessGroup | None = None,
           power_of_two: bool = False) -> torch.Tensor:
    """fp8_max / amax (per tensor, or per slice along `dim`): what x is multiplied by before the cast."""
    scale = torch.finfo(fp8).max / _amax(x, dim, group).clamp(min=AMAX_FLOOR)
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_two else scale


def _cast(x: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """x * scale in fp32, saturated to the format's range (torch's cast would make NaN of an overflow)."""
    largest = torch.finfo(fp8).max
    return (x.float() * scale).clamp(-largest, largest).to(fp8)


def _column_major(x: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major (torch._scaled_mm's second operand)."""
    return x.t().contiguous().t()


class ShardedDims:
    """Which GEMM dimensions of a linear y[M, N] = x[M, K] W[N, K]^T are split over a tensor-parallel group."""

    def __init__(self, group: dist.ProcessGroup | None = None, n: bool = False, k: bool = False) -> None:
        self.n = group if n else None  # column parallel: N split (W rows, y columns)
        self.k = group if k else None  # row parallel: K split (W columns, x columns)
        self.weight = group if (n or k) else None


WHOLE = ShardedDims()


class Float8Matmul(torch.autograd.Function):
    """y = x W^T with the three GEMMs (forward, dgrad, wgrad) in FP8, scaled by the recipe; x [M, K], W [N, K]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: str, dims: ShardedDims,
                out_dtype: torch.dtype) -> torch.Tensor:
        ctx.recipe, ctx.dims, ctx.out_dtype = recipe, dims, out_dtype
        ctx.input_dtype, ctx.weight_dtype = x.dtype, weight.dtype
        if recipe == "tensorwise":
            x_scale, w_scale = _scale(x, E4M3, group=dims.k), _scale(weight, E4M3, group=dims.weight)
            x8, w8 = _cast(x, x_scale, E4M3), _cast(weight, w_scale, E4M3)
            ctx.save_for_backward(x8, w8, x_scale, w_scale)
            return torch._scaled_mm(x8, w8.t(), scale_a=x_scale.reciprocal(), scale_b=w_scale.reciprocal(),
                                    out_dtype=out_dtype)
        # rowwise: along K, the contraction of the forward GEMM
        x_scale = _scale(x, E4M3, -1, dims.k, power_of_two=True)  # [M, 1]
        w_scale = _scale(weight, E4M3, -1, dims.k, power_of_two=True)  # [N, 1]
        ctx.save_for_backward(x, weight)
        return torch._scaled_mm(_cast(x, x_scale, E4M3), _cast(weight, w_scale, E4M3).t(),
                                scale_a=x_scale.reciprocal(), scale_b=w_scale.reciprocal().view(1, -1), out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dims, out_dtype = ctx.dims, ctx.out_dtype
        grad = grad.contiguous()
        if ctx.recipe == "tensorwise":
            x8, w8, x_scale, w_scale = ctx.saved_tensors
            g_scale = _scale(grad, E5M2, group=dims.n)
            g8 = _cast(grad, g_scale, E5M2)
            g_inverse = g_scale.reciprocal()
            grad_x = torch._scaled_mm(g8, _column_major(w8), scale_a=g_inverse, scale_b=w_scale.reciprocal(),
                                      out_dtype=out_dtype)
            grad_w = torch._scaled_mm(g8.t().contiguous(), _column_major(x8), scale_a=g_inverse,
                                      scale_b=x_scale.reciprocal(), out_dtype=out_dtype)
            return grad_x.to(ctx.input_dtype), grad_w.to(ctx.weight_dtype), None, None, None
        x, weight = ctx.saved_tensors
        # dgrad: grad_x[M, K] = g[M, N] W[N, K], contraction over N
        g_rows = _scale(grad, E4M3, -1, dims.n, power_of_two=True)  # [M, 1]
        w_columns = _scale(weight, E4M3, 0, dims.n, power_of_two=True)  # [1, K]
        grad_x = torch._scaled_mm(_cast(grad, g_rows, E4M3), _column_major(_cast(weight, w_columns, E4M3)),
                                  scale_a=g_rows.reciprocal(), scale_b=w_columns.reciprocal(), out_dtype=out_dtype)
        # wgrad: grad_w[N, K] = g^T[N, M] x[M, K], contraction over M (the tokens, never split here)
        g_columns = _scale(grad, E4M3, 0, power_of_two=True)  # [1, N]
        x_columns = _scale(x, E4M3, 0, power_of_two=True)  # [1, K]
        grad_w = torch._scaled_mm(_cast(grad, g_columns, E4M3).t().contiguous(),
                                  _column_major(_cast(x, x_columns, E4M3)),
                                  scale_a=g_columns.reciprocal().view(-1).unsqueeze(1), scale_b=x_columns.reciprocal(),
                                  out_dtype=out_dtype)
        return grad_x.to(ctx.input_dtype), grad_w.to(ctx.weight_dtype), None, None, None


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """What the GEMMs write: the autocast dtype where autocast is on (one GPU, fp32 weights), else x's dtype."""
    if x.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return x.dtype


def float8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: str, dims: ShardedDims = WHOLE) -> torch.Tensor | None:
    """x[..., K] W[N, K]^T in FP8 on local tensors; None where the FP8 GEMM cannot take the rows (CUDA, rows not a
    multiple of 16): the caller runs that one in BF16."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.is_cuda and rows.shape[0] % TILE:
        return None
    out = Float8Matmul.apply(rows, weight, recipe, dims, _out_dtype(x))
    return out.view(*x.shape[:-1], weight.shape[0])


class Float8Linear(nn.Linear):
    """nn.Linear whose GEMMs run in FP8 (same parameters and names, so checkpoints and tensor-parallel plans
    address it as the linear it replaces)."""

    recipe = "tensorwise"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if isinstance(self.weight, DTensor):
            return self._sharded_forward(x)
        out = float8_linear(x, self.weight, self.recipe)
        if out is None:
            return F.linear(x, self.weight, self.bias)
        return out + self.bias if self.bias is not None else out

    def _sharded_forward(self, x):
        """Under tensor parallelism: the local GEMM of the weight's shard. Column parallel (weight Shard(0)): the
        replicated input's gradient is a partial sum over tp; row parallel (Shard(1)): the output is partial."""
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        weight = self.weight
        mesh, (placement,) = weight.device_mesh, weight.placements
        group = mesh.get_group()
        column = placement == Shard(0)
        if column:
            local = x.to_local(grad_placements=[Partial()]) if isinstance(x, DTensor) else x
            dims = ShardedDims(group, n=True)
        elif placement == Shard(1):
            local = x.to_local() if isinstance(x, DTensor) else x
            dims = ShardedDims(group, k=True)
        else:
            local, dims = (x.to_local() if isinstance(x, DTensor) else x), WHOLE
        out = float8_linear(local, weight.to_local(), self.recipe, dims)
        if out is None:
            out = F.linear(local, weight.to_local())
        if column:
            if self.bias is not None:
                out = out + self.bias.to_local()
            return DTensor.from_local(out, mesh, [Shard(out.dim() - 1)], run_check=False)
        result = DTensor.from_local(out, mesh, [Partial() if placement == Shard(1) else Replicate()], run_check=False)
        return result + self.bias if self.bias is not None else result


def convert_to_float8(model: nn.Module, recipe: str, tp: int = 1) -> list[str]:
    """Swap the block linears (attention and dense MLP) of `model` (built on meta, before any parallelism) for
    Float8Linear with `recipe`; the names swapped. A linear whose features, after a tp split, 16 does not divide
    stays a BF16 nn.Linear."""
    from fivefold.models import MoE
    from fivefold.models.transformer import Attention, FeedForward

    swapped = []
    for name, module in model.named_modules():
        if not isinstance(module, (Attention, FeedForward)) or isinstance(module, MoE):
            continue
        for leaf, linear in list(module.named_children()):
            if type(linear) is not nn.Linear:
                continue
            if linear.in_features % (TILE * tp) or linear.out_features % (TILE * tp):
                continue
            fp8 = Float8Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                               device=linear.weight.device, dtype=linear.weight.dtype)
            fp8.weight, fp8.bias = linear.weight, linear.bias
            fp8.recipe = recipe
            setattr(module, leaf, fp8)
            swapped.append(f"{name}.{leaf}")
    return swapped
