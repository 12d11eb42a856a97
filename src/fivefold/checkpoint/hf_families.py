"""The Hugging Face model families fivefold reads and writes, and how their names map onto fivefold's.

    llama      LlamaForCausalLM      dense
    mixtral    MixtralForCausalLM    every layer MoE, experts w1 (gate) / w3 (up) / w2 (down), top-k renormalised
    qwen3_moe  Qwen3MoeForCausalLM   per-head q/k RMSNorm, head_dim apart from hidden/heads, MoE layers chosen by
                                     mlp_only_layers / decoder_sparse_step, top-k renormalised when norm_topk_prob

Names are the checkpoint names on the Hub (what save_pretrained writes: one tensor per expert); fivefold
stacks the experts of a layer into one [experts, ...] tensor. The family of a ModelSpec follows from it:
MoE with q/k norms is Qwen3-MoE, MoE without is Mixtral, dense is Llama.
"""

from __future__ import annotations

from fivefold.errors import SpecError
from fivefold.spec import ModelSpec
from fivefold.spec.jsonfields import Fields

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# Families people will try that use a piece fivefold does not implement: one line says which.
UNSUPPORTED = {
    "qwen2_moe": "Qwen2-MoE's shared expert is scaled by its own sigmoid gate (shared_expert_gate), which "
                 "fivefold's MoE block does not implement",
    "deepseek_v3": "DeepSeek-V3's multi-head latent attention and sigmoid group-limited router are not implemented",
    "gpt_oss": "gpt-oss's attention sinks, biased experts and clamped SwiGLU are not implemented (the "
               "gpt-oss-120b preset is for planning only)",
}
_ATTENTION = {"attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
              "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
              "attention.q_norm.weight": "self_attn.q_norm.weight",
              "attention.k_norm.weight": "self_attn.k_norm.weight",
              "attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
_DENSE_MLP = {"feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
              "feed_forward.w2.weight": "mlp.down_proj.weight"}
# family -> (MoE module name, expert matrix names for fivefold's w1, w2, w3)
_MOE = {"mixtral": ("block_sparse_moe", {"w1": "w1", "w2": "w2", "w3": "w3"}),
        "qwen3_moe": ("mlp", {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"})}
TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
       "output.weight": "lm_head.weight"}


def family_of(spec: ModelSpec) -> str:
    """The HF family a ModelSpec is written as; refuses what no supported family can hold, in one line."""
    if spec.mlp != "swiglu" or spec.norm != "rmsnorm" or spec.position != "rope":
        raise SpecError("model", spec.name, "only Llama-style models (swiglu, rmsnorm, rope) can be exported to "
                                            "Hugging Face")
    if not spec.is_moe:
        if spec.qk_norm:
            raise SpecError("model.qk_norm", True, "a dense model with q/k norms (Qwen3) cannot be exported; "
                                                   "Llama, Mixtral and Qwen3-MoE can")
        return "llama"
    if spec.shared_experts:
        raise SpecError("model.shared_experts", spec.shared_experts, "neither Mixtral nor Qwen3-MoE has shared "
                                                                     "experts; cannot export")
    if spec.router_bias_rate > 0:
        raise SpecError("model.router_bias_rate", spec.router_bias_rate, "the auxiliary-free router bias has no "
                                                                         "place in Mixtral or Qwen3-MoE")
    if spec.qk_norm:
        return "qwen3_moe"
    if not spec.router_norm_topk or spec.first_dense_layers or spec.moe_every != 1:
        raise SpecError("model", spec.name, "Mixtral renormalises the top-k weights and has MoE in every layer; "
                                            "set qk_norm=true to export as Qwen3-MoE instead")
    return "mixtral"


def hf_names(spec: ModelSpec) -> dict[str, str | list[str]]:
    """fivefold tensor name -> HF name, or the list of per-expert HF names of a stacked expert tensor."""
    family = family_of(spec)
    names: dict[str, str | list[str]] = dict(TOP)
    for layer in range(spec.layers):
        prefix = f"model.layers.{layer}."
        pairs = dict(_ATTENTION)
        if not spec.qk_norm:
            del pairs["attention.q_norm.weight"], pairs["attention.k_norm.weight"]
        if spec.is_moe_layer(layer):
            module, matrices = _MOE[family]
            pairs["feed_forward.router.weight"] = f"{module}.gate.weight"
            for ours, theirs in matrices.items():
                names[f"layers.{layer}.feed_forward.experts.{ours}"] = [
                    f"{prefix}{module}.experts.{e}.{theirs}.weight" for e in range(spec.experts)]
        else:
            pairs.update(_DENSE_MLP)
        names.update({f"layers.{layer}.{ours}": prefix + theirs for ours, theirs in pairs.items()})
    return names


def spec_fields_of_family(fields: Fields, model_type: str) -> dict:
    """ModelSpec fields beyond the Llama ones for a Mixtral or Qwen3-MoE config.json, read with exact types."""
    config, source = fields.data, fields.source
    sliding = config.get("sliding_window")
    if sliding and (model_type == "mixtral" or fields.flag("use_sliding_window", False)):
        raise SpecError(f"{source}:sliding_window", sliding, "sliding-window attention is not imported; must be null")
    aux = fields.real("router_aux_loss_coef", 0.0, minimum=0)
    if model_type == "mixtral":
        if fields.real("router_jitter_noise", 0.0):
            raise SpecError(f"{source}:router_jitter_noise", config["router_jitter_noise"],
                            "router noise is not implemented; must be 0")
        return {"experts": fields.count("num_local_experts"), "top_k": fields.count("num_experts_per_tok"),
                "expert_ffn_hidden": fields.count("intermediate_size"), "router_norm_topk": True,
                "aux_loss_coef": aux}
    layers = fields.count("num_hidden_layers")
    dense = sorted(fields.counts("mlp_only_layers", []))
    if dense != list(range(len(dense))) or len(dense) >= layers:
        raise SpecError(f"{source}:mlp_only_layers", dense, "only the first layers may be dense, e.g. [0, 1]")
    # The Hub's Qwen3-MoE configs say num_experts; transformers 5 writes num_local_experts.
    experts = fields.count("num_experts") if config.get("num_experts") is not None else fields.count(
        "num_local_experts")
    return {"qk_norm": True, "experts": experts, "top_k": fields.count("num_experts_per_tok"),
            "expert_ffn_hidden": fields.count("moe_intermediate_size"),
            "router_norm_topk": fields.flag("norm_topk_prob", False), "aux_loss_coef": aux,
            "first_dense_layers": len(dense), "moe_every": fields.count("decoder_sparse_step", 1)}


def family_config(spec: ModelSpec, family: str) -> dict:
    """The config.json fields of `family` beyond the Llama ones."""
    if family == "llama":
        return {"architectures": [ARCHITECTURES["llama"]], "model_type": "llama", "mlp_bias": False}
    common = {"architectures": [ARCHITECTURES[family]], "model_type": family, "num_experts_per_tok": spec.top_k,
              "router_aux_loss_coef": spec.aux_loss_coef, "output_router_logits": False, "sliding_window": None}
    if family == "mixtral":
        return {**common, "num_local_experts": spec.experts, "intermediate_size": spec.expert_ffn_hidden,
                "router_jitter_noise": 0.0}
    return {**common, "num_experts": spec.experts, "moe_intermediate_size": spec.expert_ffn_hidden,
            "norm_topk_prob": spec.router_norm_topk, "decoder_sparse_step": spec.moe_every,
            "mlp_only_layers": list(range(spec.first_dense_layers)), "use_sliding_window": False}
