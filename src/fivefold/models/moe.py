"""The mixture-of-experts block that replaces the dense MLP in the MoE layers of a ModelSpec.

    router (fp32 softmax over experts) -> top_k experts per token (renormalised when router_norm_topk)
    -> token copies sorted by expert -> dispatcher (local, or all-to-all over the ep group)
    -> each expert's SwiGLU/GeLU MLP on its rows -> back -> weighted sum over the top_k copies
    (+ shared experts every token visits).

Experts run as three grouped GEMMs (`torch._grouped_mm`, as TorchTitan's MoE runs them: gate, up and down,
each one launch over every local expert's rows) where that kernel runs: CUDA from sm90 in bf16. Elsewhere
(CPU, older GPUs, fp32, a torch without it) a Python loop issues a GEMM per expert. `GroupedExperts.gemm`
chooses: "auto" (that rule), "grouped" (also on CPU, where torch runs it in fp32: the parity tests) or
"loop" (`fivefold train --expert-gemm`). Same math, so parity holds across the two.

Dropless: every routed copy is computed, there is no capacity factor. The dispatcher is the only thing
expert parallelism changes (runtime/expert_parallel.py swaps in an all-to-all one), so one code path
serves every plan and parity with the single-process run is by construction.

Auxiliary load-balancing loss (Switch Transformer, Fedus et al. 2021, eq. 4; Mixtral's
load_balancing_loss_func): E * sum_e f_e * P_e with f_e the fraction of tokens routed to expert e
(counting every top_k copy, so a balanced router scores top_k) and P_e the mean router probability.
It is computed per sequence and summed over the sequences of the global batch (DeepSeek-V3's
sequence-wise balance loss), so it splits exactly over micro-batches and replicas like the token loss.
The loss enters backward through AuxLossToGrad: the block's output carries it, so pipeline schedules
and the language-model loss need no change (Megatron-Core's MoEAuxLossAutoScaler does the same).

Auxiliary-loss-free balancing (DeepSeek-V3, Liu et al. 2024, section 2.1.2): a per-expert bias added to
the scores for selection only; the runtime moves it by router_bias_rate * sign(mean load - load) after
every step from the global expert load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.spec import ModelSpec


class AuxLossToGrad(torch.autograd.Function):
    """Identity on `output`; in backward, also gives the auxiliary loss the gradient 1, so it is part of
    the training loss without being added to what the model returns."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss)


def unchanged(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class LocalTokens:
    """Every token of this rank's input goes through the block here (no tensor parallel around it)."""

    parts = 1  # ranks sharing each sequence of the block's input (tp x cp when they split it)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def sum_over_sequence(self, per_sequence: torch.Tensor) -> torch.Tensor:
        return per_sequence


def balanced_counts(copies: int, experts: int) -> list[int]:
    """The balanced expectation of the copies each expert gets (the first experts take the remainder)."""
    base, extra = divmod(copies, experts)
    return [base + (expert < extra) for expert in range(experts)]


class LocalDispatch:
    """All experts live here (no expert parallelism): rows go straight to the experts."""

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor | list[int]) -> tuple[torch.Tensor, list[int], object]:
        return rows, counts if isinstance(counts, list) else counts.tolist(), None

    def combine(self, rows: torch.Tensor, state: object) -> torch.Tensor:
        return rows


# torch._grouped_mm's CUDA kernel is CUTLASS's Hopper (and later) grouped GEMM: compute capability 9.0 and up.
GROUPED_MM_CAPABILITY = (9, 0)


def has_grouped_mm() -> bool:
    """This torch has torch._grouped_mm (2.8 and later)."""
    return hasattr(torch, "_grouped_mm")


def grouped_mm_on_cuda(device: torch.device | int | None = None) -> bool:
    """torch._grouped_mm runs on this CUDA device (sm90 and later) with this torch."""
    if not (has_grouped_mm() and torch.cuda.is_available()):
        return False
    return torch.cuda.get_device_capability(device) >= GROUPED_MM_CAPABILITY


def cuda_compute_dtype(rows: torch.Tensor) -> torch.dtype:
    """The dtype the expert GEMMs compute in on CUDA: bf16 under bf16 autocast, else the rows' own."""
    if torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16:
        return torch.bfloat16
    return rows.dtype


def expert_gemm_of(choice: str, rows: torch.Tensor) -> str:
    """"grouped" or "loop": what runs for `choice` (auto | grouped | loop, --expert-gemm) on these rows. "auto" is grouped on CUDA where
    torch._grouped_mm runs and the experts compute in bf16 (its CUDA kernel takes bf16 only), the loop elsewhere."""
    if choice != "auto":
        return choice
    if rows.is_cuda and grouped_mm_on_cuda(rows.device) and cuda_compute_dtype(rows) == torch.bfloat16:
        return "grouped"
    return "loop"


class GroupedExperts(nn.Module):
    """`experts` MLPs stored as stacked weights w1/w3 [E, f, h] and w2 [E, h, f] (nn.Linear's out x in
    per expert, so Hugging Face experts copy over as they are). Under expert parallelism these are
    DTensors sharded on dim 0 over the ep mesh and forward uses this rank's slice."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        e, h, f = spec.experts, spec.hidden, spec.expert_ffn_hidden
        self.swiglu = spec.mlp == "swiglu"
        self.w1 = nn.Parameter(torch.empty(e, f, h))
        self.w2 = nn.Parameter(torch.empty(e, h, f))
        self.w3 = nn.Parameter(torch.empty(e, f, h)) if self.swiglu else None
        self.gemm = "auto"  # auto | grouped | loop: the runtime sets it from --expert-gemm
        self.ran: str | None = None  # what the last forward ran: "grouped" or "loop"

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """`rows` grouped by local expert, counts[i] rows for local expert i."""
        if not counts:
            return rows.new_zeros(0, self.w2.shape[1])
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        # No rows at all: the loop's empty GEMMs still give every weight its (zero) gradient.
        self.ran = expert_gemm_of(self.gemm, rows) if rows.shape[0] else "loop"
        if self.ran == "grouped":
            return self._grouped(rows, counts, w1, w2, w3)
        return self._loop(rows, counts, w1, w2, w3)

    def _loop(self, rows: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor,
              w3: torch.Tensor | None) -> torch.Tensor:
        """A GEMM per expert. unbind, not w1[index]: indexing's backward writes a zero-filled gradient of the whole
        [E, f, h] stack per expert (E^2 traffic, a third of an MoE step on CPU); unbind's stacks the E slices once."""
        up, down, gate = w1.unbind(0), w2.unbind(0), (w3.unbind(0) if w3 is not None else None)
        outputs = []
        for index, chunk in enumerate(rows.split(counts)):
            if gate is not None:
                hidden = F.silu(chunk @ up[index].T) * (chunk @ gate[index].T)
            else:
                hidden = F.gelu(chunk @ up[index].T)
            outputs.append(hidden @ down[index].T)
        return torch.cat(outputs)

    def _grouped(self, rows: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor,
                 w3: torch.Tensor | None) -> torch.Tensor:
        """One torch._grouped_mm per projection over every expert's rows (offsets: the end row of each expert).
        On CUDA in bf16 (cast here under autocast, which does not cover the op), on CPU in the rows' dtype."""
        dtype = cuda_compute_dtype(rows) if rows.is_cuda else rows.dtype
        ends = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
        offsets = ends.to(rows.device, non_blocking=True)
        x = rows.to(dtype)

        def project(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return torch._grouped_mm(inputs, weight.to(dtype).transpose(-2, -1), offs=offsets)

        if w3 is not None:
            hidden = F.silu(project(x, w1)) * project(x, w3)
        else:
            hidden = F.gelu(project(x, w1))
        return project(hidden, w2)


def _local(weight: torch.Tensor | None) -> torch.Tensor | None:
    if weight is not None and hasattr(weight, "to_local"):  # a DTensor: this rank's experts
        return weight.to_local()
    return weight


class SharedExperts(nn.Module):
    """Experts every token visits, as one MLP of width shared_experts * expert_ffn_hidden."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        width = spec.shared_experts * spec.expert_ffn_hidden
        self.swiglu = spec.mlp == "swiglu"
        self.w1 = nn.Linear(spec.hidden, width, bias=False)
        self.w2 = nn.Linear(width, spec.hidden, bias=False)
        self.w3 = nn.Linear(spec.hidden, width, bias=False) if self.swiglu else None

    def forward(self, x: torch.Tensor, synced=unchanged) -> torch.Tensor:
        """`synced` wraps each weight (runtime: sums its gradient over the tp ranks that split the tokens)."""
        w1, w2 = synced(self.w1.weight), synced(self.w2.weight)
        if self.swiglu:
            return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, synced(self.w3.weight)), w2)
        return F.linear(F.gelu(F.linear(x, w1)), w2)


class MoE(nn.Module):
    """Top-k routed experts (+ shared experts): [batch, seq, hidden] -> [batch, seq, hidden]."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.experts_count, self.top_k = spec.experts, spec.top_k
        self.norm_topk = spec.router_norm_topk
        self.aux_loss_coef = spec.aux_loss_coef
        self.router = nn.Linear(spec.hidden, spec.experts, bias=False)
        self.experts = GroupedExperts(spec)
        self.shared_experts = SharedExperts(spec) if spec.shared_experts else None
        if spec.router_bias_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(spec.experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.dispatcher: LocalDispatch = LocalDispatch()
        # Which of the input's tokens this rank routes and how the rest of the sequence is reached; and the
        # wrapper of the router's and shared experts' weights (runtime/expert_folding.py sets both under tp).
        self.tokens: LocalTokens = LocalTokens()
        self.synced = unchanged
        # The dry run (fake tensors, no values): every expert gets the balanced share of the copies, known
        # without reading the router's choice (balanced_counts).
        self.balanced = False
        # 1 / (MoE layers x sequences in the global batch): the runtime sets it so the auxiliary loss sums
        # over the global batch like the token loss; None = a mean over this call's sequences.
        self.aux_loss_scale: float | None = None
        self.moe_layers = spec.moe_layers
        # Since the last take_stats(): tokens routed to each expert, and the summed auxiliary loss (both on the
        # block's device, read once a step).
        self.load: torch.Tensor | None = None  # made on first use (the module is built on meta)
        self.aux_loss_sum: torch.Tensor | float = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tokens.scatter(x)
        batch, seq, hidden = x.shape
        tokens = x.reshape(-1, hidden)
        # Routing in fp32 whatever the compute dtype: top-k choices must not flip with bf16 rounding. Autocast
        # (one GPU, fp32 weights) would run this linear in bf16 whatever its inputs are, so it is switched off here.
        with torch.autocast(tokens.device.type, enabled=False):
            logits = F.linear(tokens.float(), self.synced(self.router.weight).float())
        scores = logits.softmax(dim=-1)
        chooser = scores if self.expert_bias is None else scores + self.expert_bias
        chosen = chooser.topk(self.top_k, dim=-1).indices  # [tokens, top_k]
        weights = scores.gather(-1, chosen)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)

        flat = chosen.flatten()
        if self.balanced:  # copies stand in expert order as they come; sizes from the count alone
            order = torch.arange(flat.shape[0], device=flat.device)
            counts: torch.Tensor | list[int] = balanced_counts(flat.shape[0], self.experts_count)
        else:
            order = flat.argsort(stable=True)  # token copies grouped by expert, in token order within one
            counts = torch.bincount(flat, minlength=self.experts_count)
        rows = tokens[order // self.top_k]
        received, local_counts, state = self.dispatcher.dispatch(rows, counts)
        returned = self.dispatcher.combine(self.experts(received, local_counts), state)
        per_copy = returned[order.argsort()].view(-1, self.top_k, hidden)
        out = (per_copy * weights.unsqueeze(-1).to(per_copy.dtype)).sum(dim=1)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens, self.synced)
        out = out.view(batch, seq, hidden)

        recording = torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1  # not a recompute
        recording = recording and not self.balanced  # the dry run's stand-in routing has no statistics
        if recording:
            counted = counts.detach().to(torch.float64)
            self.load = counted if self.load is None else self.load + counted
        if self.aux_loss_coef > 0 and torch.is_grad_enabled():
            aux = self.aux_loss(scores, chosen, batch, seq)
            if recording:  # kept on the device: a .item() here would make the CPU wait for the GPU every layer
                self.aux_loss_sum = self.aux_loss_sum + aux.detach().double()
            out = AuxLossToGrad.apply(out, aux)
        return self.tokens.gather(out)

    def aux_loss(self, scores: torch.Tensor, chosen: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
        """coef x sum over sequences of E * sum_e f_e P_e, times aux_loss_scale. When tp/cp ranks share a
        sequence (tokens.parts > 1), f_e's counts are summed over them first (no gradient flows through f)
        and each rank adds its own tokens' P_e: the ranks' losses then sum to the whole sequence's, and so
        do their gradients."""
        routed = torch.zeros_like(scores).scatter_(1, chosen, 1.0)  # [tokens, E]: 1 where a copy went
        full_seq = seq * self.tokens.parts
        routed_sum = self.tokens.sum_over_sequence(routed.view(batch, seq, -1).sum(dim=1))  # f x full_seq
        probability_sum = scores.view(batch, seq, -1).sum(dim=1)  # this rank's share of P x full_seq
        # E * sum_e f_e P_e, the two 1/full_seq folded into one scalar (as many ops as two means)
        per_sequence = (self.experts_count / full_seq**2) * (routed_sum * probability_sum).sum(dim=-1)
        scale = self.aux_loss_scale if self.aux_loss_scale is not None else 1.0 / (self.moe_layers * batch)
        return self.aux_loss_coef * per_sequence.sum() * scale

    def take_stats(self) -> tuple[torch.Tensor, torch.Tensor | float]:
        """Tokens per expert and the summed auxiliary loss recorded since the last call (tensors on the block's
        device, or 0.0 when nothing was recorded); resets both."""
        load = self.load if self.load is not None else torch.zeros(self.experts_count, dtype=torch.float64)
        aux = self.aux_loss_sum
        self.load, self.aux_loss_sum = None, 0.0
        return load, aux
