"""ModelSpec: the shape of a decoder-only transformer, its presets, and how users name one."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from fivefold.errors import SpecError, require
from fivefold.spec.checks import MAX_COUNT, MAX_LAYERS, check_field_types, check_table, divisors
from fivefold.spec.units import read_toml_file

MAX_EXPERTS = 1 << 16  # the largest MoE models have 256-1,024 routed experts
MAX_SHARED_EXPERTS = 64
MAX_HEAD_DIM = 1 << 16
MLP_KINDS = ("gelu", "swiglu")
NORM_KINDS = ("layernorm", "rmsnorm")
POSITION_KINDS = ("learned", "rope")
ROUTER_KINDS = ("softmax",)


def llama_ffn_hidden(hidden: int, multiple_of: int = 256, multiplier: float = 1.0) -> int:
    """SwiGLU width as Llama computes it: 2/3 of 4h, scaled, rounded up to a multiple (Meta llama model.py)."""
    width = int(multiplier * int(2 * 4 * hidden / 3))
    return multiple_of * ((width + multiple_of - 1) // multiple_of)


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer. Dense unless `experts` > 0."""

    name: str = "custom"  # preset name or a label for reports
    layers: int = 2  # transformer blocks
    hidden: int = 64  # model width h
    heads: int = 4  # attention (query) heads
    kv_heads: int = 0  # key/value heads for GQA; 0 means equal to heads
    ffn_hidden: int = 0  # MLP inner width; 0 means 4h for gelu, Llama rounding for swiglu
    mlp: str = "swiglu"  # "gelu" (GPT) or "swiglu" (Llama)
    norm: str = "rmsnorm"  # "layernorm" (GPT) or "rmsnorm" (Llama)
    position: str = "rope"  # "learned" (GPT) or "rope" (Llama)
    vocab: int = 256  # vocabulary size
    tied_embeddings: bool = False  # LM head shares the input embedding matrix
    max_seq_len: int = 4096  # longest sequence (size of learned position table)
    rope_theta: float = 10000.0  # RoPE base
    norm_eps: float = 1e-5  # epsilon of the norms
    head_dim: int = 0  # width of one attention head; 0 means hidden/heads (Qwen3/GPT-OSS set it apart)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    experts: int = 0  # MoE experts per layer; 0 = dense
    top_k: int = 0  # experts each token is routed to (MoE)
    expert_ffn_hidden: int = 0  # MLP width of one expert; 0 means ffn_hidden
    shared_experts: int = 0  # experts every token visits besides its top_k (each expert_ffn_hidden wide)
    router: str = "softmax"  # router scores: softmax over all experts' logits, computed in fp32
    router_norm_topk: bool = True  # renormalise the top_k weights to sum to 1 (Mixtral; Qwen3 norm_topk_prob)
    aux_loss_coef: float = 0.0  # Switch/Mixtral load-balancing loss weight; 0 = no auxiliary loss
    router_bias_rate: float = 0.0  # DeepSeek-V3 auxiliary-loss-free bias update speed; 0 = off
    first_dense_layers: int = 0  # leading layers that keep the dense MLP (DeepSeek first_k_dense_replace)
    moe_every: int = 1  # after those, layer i is MoE when (i + 1) % moe_every == 0 (Qwen decoder_sparse_step)
    sliding_window: int = 0  # keys each query sees in a sliding-window layer (itself included); 0 = none
    full_attention_every: int = 0  # with a window: layer i keeps full attention when (i + 1) % n == 0
    #                                (GPT-OSS 2, Gemma 3 6); 0 = every layer slides

    def __post_init__(self) -> None:
        # Fill derived defaults, then validate; frozen, so write through object.__setattr__.
        check_field_types(self, "model")  # before the derived defaults compute with the values
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.head_dim == 0 and isinstance(self.heads, int) and self.heads > 0 and self.hidden % self.heads == 0:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.ffn_hidden == 0 and self.hidden > 0:
            width = 4 * self.hidden if self.mlp == "gelu" else llama_ffn_hidden(self.hidden)
            object.__setattr__(self, "ffn_hidden", width)
        if self.experts and self.expert_ffn_hidden == 0:
            object.__setattr__(self, "expert_ffn_hidden", self.ffn_hidden)
        self.validate()

    def validate(self) -> None:
        check_field_types(self, "model")
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "max_seq_len"):
            value = getattr(self, name)
            require(value > 0, f"model.{name}", value, "must be a positive integer")
            limit = MAX_LAYERS if name == "layers" else MAX_COUNT
            require(value <= limit, f"model.{name}", value, f"must be at most {limit:,}; a larger value is not a "
                    "real model")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            require(value > 0, f"model.{name}", value, "must be a positive finite number")
        require(self.mlp in MLP_KINDS, "model.mlp", self.mlp, f"use one of {', '.join(MLP_KINDS)}")
        require(self.norm in NORM_KINDS, "model.norm", self.norm, f"use one of {', '.join(NORM_KINDS)}")
        require(self.position in POSITION_KINDS, "model.position", self.position,
                f"use one of {', '.join(POSITION_KINDS)}")
        require(self.head_dim != 0 or self.hidden % self.heads == 0, "model.hidden", self.hidden,
                f"must be divisible by heads={self.heads} (or set model.head_dim)")
        require(isinstance(self.head_dim, int) and 0 < self.head_dim <= MAX_HEAD_DIM, "model.head_dim",
                self.head_dim, f"must be a positive integer up to {MAX_HEAD_DIM:,} (0 means hidden/heads)")
        if self.heads % self.kv_heads:
            raise SpecError("model.kv_heads", self.kv_heads,
                            f"must divide heads={self.heads}; valid: {', '.join(map(str, divisors(self.heads)))}")
        if self.position == "rope":
            field = "model.hidden" if self.head_dim * self.heads == self.hidden else "model.head_dim"
            require(self.head_dim % 2 == 0, field, getattr(self, field[6:]),
                    f"rope needs an even head size; head_dim = {self.head_dim}")
        self._validate_moe()
        require(isinstance(self.sliding_window, int) and self.sliding_window >= 0, "model.sliding_window",
                self.sliding_window, "must be 0 (full attention) or a positive number of tokens")
        require(isinstance(self.full_attention_every, int) and self.full_attention_every >= 0,
                "model.full_attention_every", self.full_attention_every,
                "must be 0 (every layer slides) or n (every n-th layer keeps full attention)")

    def _validate_moe(self) -> None:
        require(isinstance(self.experts, int) and 0 <= self.experts <= MAX_EXPERTS, "model.experts", self.experts,
                f"must be 0 (dense) or a positive count up to {MAX_EXPERTS:,}")
        require(self.router in ROUTER_KINDS, "model.router", self.router, f"use one of {', '.join(ROUTER_KINDS)}")
        for name in ("aux_loss_coef", "router_bias_rate"):
            value = getattr(self, name)
            require(isinstance(value, (int, float)) and value >= 0, f"model.{name}", value, "must be >= 0")
        require(isinstance(self.moe_every, int) and self.moe_every >= 1, "model.moe_every", self.moe_every,
                "must be a positive integer (1 = every layer is MoE)")
        require(isinstance(self.first_dense_layers, int) and 0 <= self.first_dense_layers < self.layers,
                "model.first_dense_layers", self.first_dense_layers, f"must be between 0 and layers-1={self.layers - 1}")
        require(isinstance(self.shared_experts, int) and 0 <= self.shared_experts <= MAX_SHARED_EXPERTS,
                "model.shared_experts", self.shared_experts, f"must be 0 or a count up to {MAX_SHARED_EXPERTS}")
        require(self.expert_ffn_hidden <= MAX_COUNT, "model.expert_ffn_hidden", self.expert_ffn_hidden,
                f"must be at most {MAX_COUNT:,}; a larger value is not a real model")
        for name in ("aux_loss_coef", "router_bias_rate"):
            require(getattr(self, name) <= 1e3, f"model.{name}", getattr(self, name), "must be at most 1000")
        if self.experts:
            require(1 <= self.top_k <= self.experts, "model.top_k", self.top_k,
                    f"must be between 1 and experts={self.experts}")
            require(self.expert_ffn_hidden > 0, "model.expert_ffn_hidden", self.expert_ffn_hidden,
                    "must be a positive integer")
            require(self.moe_layers > 0, "model.moe_every", self.moe_every,
                    f"leaves no MoE layer among {self.layers} layers")
        else:
            require(self.top_k == 0, "model.top_k", self.top_k, "only MoE models (experts > 0) route to top_k")
            for name, dense_value in (("shared_experts", 0), ("expert_ffn_hidden", 0), ("aux_loss_coef", 0.0),
                                      ("router_bias_rate", 0.0), ("first_dense_layers", 0), ("moe_every", 1)):
                require(getattr(self, name) == dense_value, f"model.{name}", getattr(self, name),
                        "means nothing for a dense model: only MoE models (experts > 0) use it; leave it out")

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def is_sliding_layer(self, layer: int) -> bool:
        """Whether block `layer` (0-based) attends within the sliding window only."""
        every = self.full_attention_every
        return self.sliding_window > 0 and (every == 0 or (layer + 1) % every != 0)

    @property
    def sliding_layers(self) -> int:
        if self.sliding_window <= 0:  # no window: no layer to count (the planner asks ~10^3 times)
            return 0
        return sum(self.is_sliding_layer(i) for i in range(self.layers))

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` (0-based) has the MoE block instead of the dense MLP."""
        return self.is_moe and layer >= self.first_dense_layers and (layer + 1) % self.moe_every == 0

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.layers))

    def params_per_layer(self, moe: bool | None = None) -> int:
        """Weights of one transformer block: an MoE block (all experts counted) unless moe=False or dense."""
        moe = self.is_moe if moe is None else (moe and self.is_moe)
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h  # q, k, v, o projections
        matrices = 3 if self.mlp == "swiglu" else 2
        if moe:
            experts = self.experts + self.shared_experts
            mlp = experts * matrices * h * self.expert_ffn_hidden + h * self.experts  # + router
        else:
            mlp = matrices * h * self.ffn_hidden
        norm_weights = 2 * h if self.norm == "rmsnorm" else 4 * h
        norm_weights += 2 * self.head_dim if self.qk_norm else 0
        biases = 0 if self.norm == "rmsnorm" else (q + 2 * kv + h) + (self.ffn_hidden + h)  # GPT has biases
        return attention + mlp + norm_weights + biases

    def layer_params_total(self) -> int:
        """All blocks' weights, MoE and dense layers each counted as they are."""
        moe = self.moe_layers
        return moe * self.params_per_layer(True) + (self.layers - moe) * self.params_per_layer(False)

    def active_params_per_token(self) -> int:
        """Weights one token touches (top_k + shared experts of each MoE layer): the 'A3B' of qwen3-30b-a3b."""
        matrices = 3 if self.mlp == "swiglu" else 2
        idle = (self.experts - self.top_k) * matrices * self.hidden * self.expert_ffn_hidden
        return self.num_params() - self.moe_layers * idle

    def embedding_params(self) -> int:
        positions = self.max_seq_len * self.hidden if self.position == "learned" else 0
        return self.vocab * self.hidden + positions

    def head_params(self) -> int:
        """Final norm plus the LM head (zero extra matrix when tied)."""
        final_norm = self.hidden if self.norm == "rmsnorm" else 2 * self.hidden
        return final_norm + (0 if self.tied_embeddings else self.vocab * self.hidden)

    def num_params(self) -> int:
        return self.layer_params_total() + self.embedding_params() + self.head_params()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Sources: Llama 3 model card / params.json (Meta, 2024); GPT-3 paper Table 2.1 (Brown et al. 2020);
# the 1T GPT of Narayanan et al. 2021 Table 1; MoE planning sizes from the published Hugging Face config.json
# files: mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B, openai/gpt-oss-120b.
# gpt-oss-120b is approximated for planning: its attention sinks, biases, alternating 128-token sliding window
# and clamped SwiGLU are not modelled (sizes and routing are).
PRESETS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(name="tiny", layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=256,
                      max_seq_len=256),
    "tiny-gpt": ModelSpec(name="tiny-gpt", layers=4, hidden=64, heads=4, mlp="gelu", norm="layernorm",
                          position="learned", vocab=256, max_seq_len=256),
    "small": ModelSpec(name="small", layers=8, hidden=256, heads=8, kv_heads=4, ffn_hidden=688, vocab=256,
                       max_seq_len=1024),
    # Llama 3.1 shapes with its 128K context (RoPE needs no position table, so long-context plans can use them).
    "llama3-8b": ModelSpec(name="llama3-8b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336,
                           vocab=128256, max_seq_len=131072, rope_theta=500000.0),
    "llama3-70b": ModelSpec(name="llama3-70b", layers=80, hidden=8192, heads=64, kv_heads=8,
                            ffn_hidden=28672, vocab=128256, max_seq_len=131072, rope_theta=500000.0),
    "llama3-405b": ModelSpec(name="llama3-405b", layers=126, hidden=16384, heads=128, kv_heads=8,
                             ffn_hidden=53248, vocab=128256, max_seq_len=131072, rope_theta=500000.0),
    "gpt3-175b": ModelSpec(name="gpt3-175b", layers=96, hidden=12288, heads=96, mlp="gelu", norm="layernorm",
                           position="learned", vocab=51200, max_seq_len=2048, tied_embeddings=True),
    "gpt-1t": ModelSpec(name="gpt-1t", layers=128, hidden=25600, heads=160, mlp="gelu", norm="layernorm",
                        position="learned", vocab=51200, max_seq_len=2048, tied_embeddings=True),
    "mixtral-8x7b": ModelSpec(name="mixtral-8x7b", layers=32, hidden=4096, heads=32, kv_heads=8,
                              ffn_hidden=14336, vocab=32000, max_seq_len=32768, rope_theta=1e6,
                              experts=8, top_k=2, aux_loss_coef=0.02),
    "tiny-moe": ModelSpec(name="tiny-moe", layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=256,
                          max_seq_len=256, experts=4, top_k=2, expert_ffn_hidden=64, aux_loss_coef=0.01),
    "qwen3-30b-a3b": ModelSpec(name="qwen3-30b-a3b", layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128,
                               qk_norm=True, ffn_hidden=6144, vocab=151936, max_seq_len=40960, rope_theta=1e6,
                               norm_eps=1e-6, experts=128, top_k=8, expert_ffn_hidden=768, aux_loss_coef=0.001),
    "qwen3-235b-a22b": ModelSpec(name="qwen3-235b-a22b", layers=94, hidden=4096, heads=64, kv_heads=4,
                                 head_dim=128, qk_norm=True, ffn_hidden=12288, vocab=151936, max_seq_len=40960,
                                 rope_theta=1e6, norm_eps=1e-6, experts=128, top_k=8, expert_ffn_hidden=1536,
                                 aux_loss_coef=0.001),
    "gpt-oss-120b": ModelSpec(name="gpt-oss-120b", layers=36, hidden=2880, heads=64, kv_heads=8, head_dim=64,
                              ffn_hidden=2880, vocab=201088, max_seq_len=131072, rope_theta=150000.0,
                              experts=128, top_k=4, expert_ffn_hidden=2880, aux_loss_coef=0.9),
}

_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(ModelSpec)}


def _coerce(key: str, raw: object) -> object:
    kind = _FIELD_TYPES[key]
    if not isinstance(raw, str):
        return raw
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "bool":
            if raw.lower() in ("1", "true", "yes"):
                return True
            if raw.lower() in ("0", "false", "no"):
                return False
            raise ValueError
    except ValueError:
        word = {"int": "an integer", "float": "a number", "bool": "true or false"}.get(str(kind), str(kind))
        raise SpecError(f"model.{key}", raw, f"expected {word}") from None
    return raw


def model_from_dict(values: dict, base: ModelSpec | None = None) -> ModelSpec:
    """Build a ModelSpec from a mapping; unknown keys are errors that list the known ones."""
    fields = dict(base.to_dict()) if base else {}
    if base is not None:
        # Derived defaults of the base must be recomputed if the fields they derive from change.
        for derived, sources in (("kv_heads", ("heads",)), ("ffn_hidden", ("hidden", "mlp")),
                                 ("head_dim", ("hidden", "heads")),
                                 ("expert_ffn_hidden", ("ffn_hidden", "hidden", "mlp"))):
            if any(s in values for s in sources) and derived not in values:
                fields[derived] = 0
    for key, raw in values.items():
        if key == "preset":
            continue
        if key not in _FIELD_TYPES:
            raise SpecError(f"model.{key}", raw, f"unknown field; known: {', '.join(_FIELD_TYPES)}")
        fields[key] = _coerce(key, raw)
    try:
        return ModelSpec(**fields)
    except TypeError as exc:
        raise SpecError("model", values, f"bad field value ({exc})") from None


def parse_model(text: str) -> ModelSpec:
    """A preset name, a TOML file, or inline `layers=96,hidden=12288,heads=96,vocab=51200,mlp=gelu`.

    Inline and TOML forms may start from a preset with `preset=NAME`.
    """
    text = text.strip()
    if text in PRESETS:
        return PRESETS[text]
    if text.endswith(".toml") or Path(text).is_file():
        data = read_toml_file(text, "--model")
        data = check_table(data.get("model", data), f"{text}:model", "write a [model] table of fields, "
                           "e.g. layers = 2")
        require(bool(data), "--model", text, "the file has no model fields; write a [model] table, e.g. "
                "preset = \"tiny\" or layers = 2, hidden = 64, heads = 4, vocab = 256")
        base = _preset_named(data.get("preset"))
        return model_from_dict(data, base)
    if "=" in text:
        values: dict[str, str] = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise SpecError("--model", text, f"malformed item {item!r}; write key=value pairs separated by commas")
            values[key.strip()] = value.strip()
        base = _preset_named(values.get("preset"))
        return model_from_dict(values, base)
    raise SpecError("--model", text, f"unknown preset; known: {', '.join(PRESETS)} (or a TOML file, "
                                     "or key=value pairs)")


def _preset_named(name: object) -> ModelSpec | None:
    if name is None:
        return None
    if not isinstance(name, str) or name not in PRESETS:
        raise SpecError("model.preset", name, f"unknown preset; known: {', '.join(PRESETS)}")
    return PRESETS[name]
