"""ModelSpec: the shape of a decoder-only transformer, its presets, and how users name one."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from fivefold.errors import SpecError, require
from fivefold.spec.units import read_toml_file

MLP_KINDS = ("gelu", "swiglu")
NORM_KINDS = ("layernorm", "rmsnorm")
POSITION_KINDS = ("learned", "rope")


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
    experts: int = 0  # MoE experts per layer; 0 = dense
    top_k: int = 0  # experts each token is routed to (MoE)
    expert_ffn_hidden: int = 0  # MLP width of one expert; 0 means ffn_hidden

    def __post_init__(self) -> None:
        # Fill derived defaults, then validate; frozen, so write through object.__setattr__.
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.ffn_hidden == 0 and self.hidden > 0:
            width = 4 * self.hidden if self.mlp == "gelu" else llama_ffn_hidden(self.hidden)
            object.__setattr__(self, "ffn_hidden", width)
        if self.experts and self.expert_ffn_hidden == 0:
            object.__setattr__(self, "expert_ffn_hidden", self.ffn_hidden)
        self.validate()

    def validate(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "max_seq_len"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, f"model.{name}", value, "must be a positive integer")
        require(self.mlp in MLP_KINDS, "model.mlp", self.mlp, f"use one of {', '.join(MLP_KINDS)}")
        require(self.norm in NORM_KINDS, "model.norm", self.norm, f"use one of {', '.join(NORM_KINDS)}")
        require(self.position in POSITION_KINDS, "model.position", self.position,
                f"use one of {', '.join(POSITION_KINDS)}")
        require(self.hidden % self.heads == 0, "model.hidden", self.hidden,
                f"must be divisible by heads={self.heads}")
        divisors = [d for d in range(1, self.heads + 1) if self.heads % d == 0]
        require(self.heads % self.kv_heads == 0, "model.kv_heads", self.kv_heads,
                f"must divide heads={self.heads}; valid: {', '.join(map(str, divisors))}")
        if self.position == "rope":
            require(self.head_dim % 2 == 0, "model.hidden", self.hidden,
                    f"rope needs an even head size; hidden/heads = {self.head_dim}")
        require(self.experts >= 0, "model.experts", self.experts, "must be 0 (dense) or a positive count")
        if self.experts:
            require(1 <= self.top_k <= self.experts, "model.top_k", self.top_k,
                    f"must be between 1 and experts={self.experts}")
            require(self.expert_ffn_hidden > 0, "model.expert_ffn_hidden", self.expert_ffn_hidden,
                    "must be a positive integer")
        else:
            require(self.top_k == 0, "model.top_k", self.top_k, "only MoE models (experts > 0) route to top_k")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def params_per_layer(self) -> int:
        """Weights of one transformer block (all experts counted)."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attention = h * h + 2 * h * kv + h * h  # q, k, v, o projections
        matrices = 3 if self.mlp == "swiglu" else 2
        if self.is_moe:
            mlp = self.experts * matrices * h * self.expert_ffn_hidden + h * self.experts  # + router
        else:
            mlp = matrices * h * self.ffn_hidden
        norm_weights = 2 * h if self.norm == "rmsnorm" else 4 * h
        biases = 0 if self.norm == "rmsnorm" else (h + 2 * kv + h) + (self.ffn_hidden + h)  # GPT has biases
        return attention + mlp + norm_weights + biases

    def embedding_params(self) -> int:
        positions = self.max_seq_len * self.hidden if self.position == "learned" else 0
        return self.vocab * self.hidden + positions

    def head_params(self) -> int:
        """Final norm plus the LM head (zero extra matrix when tied)."""
        final_norm = self.hidden if self.norm == "rmsnorm" else 2 * self.hidden
        return final_norm + (0 if self.tied_embeddings else self.vocab * self.hidden)

    def num_params(self) -> int:
        return self.layers * self.params_per_layer() + self.embedding_params() + self.head_params()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Sources: Llama 3 model card / params.json (Meta, 2024); GPT-3 paper Table 2.1 (Brown et al. 2020);
# Mixtral config.json (Mistral AI, 2023); the 1T GPT of Narayanan et al. 2021 Table 1.
PRESETS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(name="tiny", layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=256,
                      max_seq_len=256),
    "tiny-gpt": ModelSpec(name="tiny-gpt", layers=4, hidden=64, heads=4, mlp="gelu", norm="layernorm",
                          position="learned", vocab=256, max_seq_len=256),
    "small": ModelSpec(name="small", layers=8, hidden=256, heads=8, kv_heads=4, ffn_hidden=688, vocab=256,
                       max_seq_len=1024),
    "llama3-8b": ModelSpec(name="llama3-8b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336,
                           vocab=128256, max_seq_len=8192, rope_theta=500000.0),
    "llama3-70b": ModelSpec(name="llama3-70b", layers=80, hidden=8192, heads=64, kv_heads=8,
                            ffn_hidden=28672, vocab=128256, max_seq_len=8192, rope_theta=500000.0),
    "llama3-405b": ModelSpec(name="llama3-405b", layers=126, hidden=16384, heads=128, kv_heads=8,
                             ffn_hidden=53248, vocab=128256, max_seq_len=8192, rope_theta=500000.0),
    "gpt3-175b": ModelSpec(name="gpt3-175b", layers=96, hidden=12288, heads=96, mlp="gelu", norm="layernorm",
                           position="learned", vocab=51200, max_seq_len=2048, tied_embeddings=True),
    "gpt-1t": ModelSpec(name="gpt-1t", layers=128, hidden=25600, heads=160, mlp="gelu", norm="layernorm",
                        position="learned", vocab=51200, max_seq_len=2048, tied_embeddings=True),
    "mixtral-8x7b": ModelSpec(name="mixtral-8x7b", layers=32, hidden=4096, heads=32, kv_heads=8,
                              ffn_hidden=14336, vocab=32000, max_seq_len=32768, rope_theta=1e6,
                              experts=8, top_k=2),
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
        raise SpecError(f"model.{key}", raw, f"expected a {kind}") from None
    return raw


def model_from_dict(values: dict, base: ModelSpec | None = None) -> ModelSpec:
    """Build a ModelSpec from a mapping; unknown keys are errors that list the known ones."""
    fields = dict(base.to_dict()) if base else {}
    if base is not None:
        # Derived defaults of the base must be recomputed if the fields they derive from change.
        for derived, sources in (("kv_heads", ("heads",)), ("ffn_hidden", ("hidden", "mlp")),
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
        data = data.get("model", data)
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
    if name not in PRESETS:
        raise SpecError("model.preset", name, f"unknown preset; known: {', '.join(PRESETS)}")
    return PRESETS[name]
