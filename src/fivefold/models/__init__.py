"""The transformer family (Llama-style and GPT-style), built on the meta device and initialised from
(seed, parameter name) so the initial weights are the same under every plan."""

from fivefold.models.init import init_weights, stable_seed
from fivefold.models.moe import MoE
from fivefold.models.transformer import (Attention, FeedForward, Transformer, TransformerBlock, build_model,
                                         rope_cos_sin, rotate_half)

__all__ = ["Attention", "FeedForward", "MoE", "Transformer", "TransformerBlock", "build_model", "init_weights",
           "rope_cos_sin", "rotate_half", "stable_seed"]
