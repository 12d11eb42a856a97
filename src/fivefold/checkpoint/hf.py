"""Hugging Face checkpoints in and out: config.json + safetensors <-> ModelSpec + fivefold names.

fivefold's RoPE uses HF's rotate_half convention, so q/k weights map 1:1 with no permutation.
Llama, Mixtral and Qwen3-MoE are read and written (checkpoint/hf_families.py maps their names; the
experts of a layer are one stacked tensor here, one tensor per expert there); anything else is
refused with one line naming the file and field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from fivefold.checkpoint.hf_families import (ARCHITECTURES, UNSUPPORTED, family_config, family_of, hf_names,
                                             spec_fields_of_family)
from fivefold.errors import SpecError
from fivefold.spec import ModelSpec
from fivefold.spec.jsonfields import Fields

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# fivefold name pattern -> HF name pattern ({} is the layer index).
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def to_hf_name(name: str) -> str:
    """fivefold FQN -> HF Llama FQN ("layers.3.attention.wq.weight" -> "model.layers.3.self_attn.q_proj.weight")."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _LAYER_RE.match(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise SpecError("parameter", name, "has no Hugging Face Llama counterpart")


_FROM_HF_TOP = {hf: ours for ours, hf in _TOP_NAMES.items()}
_FROM_HF_LAYER = {hf: ours for ours, hf in _LAYER_NAMES.items()}


def from_hf_name(name: str) -> str | None:
    """HF Llama FQN -> fivefold FQN; None for tensors fivefold does not keep (e.g. rotary inv_freq)."""
    if name in _FROM_HF_TOP:
        return _FROM_HF_TOP[name]
    match = _HF_LAYER_RE.match(name)
    if match and match.group(2) in _FROM_HF_LAYER:
        return f"layers.{match.group(1)}.{_FROM_HF_LAYER[match.group(2)]}"
    return None


# fivefold's ModelSpec field -> the config.json key it is read from, so an error names the user's own key.
_HF_KEYS = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
            "kv_heads": "num_key_value_heads", "head_dim": "head_dim", "ffn_hidden": "intermediate_size",
            "vocab": "vocab_size", "max_seq_len": "max_position_embeddings", "rope_theta": "rope_theta",
            "norm_eps": "rms_norm_eps", "tied_embeddings": "tie_word_embeddings", "top_k": "num_experts_per_tok",
            "experts": "num_experts", "expert_ffn_hidden": "moe_intermediate_size",
            "router_norm_topk": "norm_topk_prob", "aux_loss_coef": "router_aux_loss_coef",
            "moe_every": "decoder_sparse_step", "first_dense_layers": "mlp_only_layers"}


def spec_from_hf_config(config: dict, source: str = CONFIG_FILE) -> ModelSpec:
    """A ModelSpec from a Llama, Mixtral or Qwen3-MoE config.json mapping; `source` names the file in errors,
    and every value is read with its exact JSON type (spec/jsonfields.py)."""
    fields = Fields(config, source)
    model_type = config.get("model_type")
    if model_type in UNSUPPORTED:
        raise SpecError(f"{source}:model_type", model_type, f"{UNSUPPORTED[model_type]}; supported: "
                                                            f"{', '.join(ARCHITECTURES)}")
    if model_type not in ARCHITECTURES:
        raise SpecError(f"{source}:model_type", model_type, "only Llama checkpoints (model_type llama, "
                                                            "LlamaForCausalLM), mixtral and qwen3_moe can be imported")
    architectures = config.get("architectures") or [ARCHITECTURES[model_type]]
    if architectures != [ARCHITECTURES[model_type]]:
        raise SpecError(f"{source}:architectures", architectures, f"only {ARCHITECTURES[model_type]} of "
                                                                  f"model_type {model_type} can be imported")
    rope_key = "rope_parameters" if config.get("rope_parameters") is not None else "rope_scaling"
    rope = Fields(fields.table(rope_key, {}), f"{source}:{rope_key}")
    rope_type = rope.text("rope_type", rope.text("type", "default"))
    if rope_type != "default":
        raise SpecError(f"{source}:{rope_key}.rope_type", rope_type, "only default RoPE is supported")
    for flag in ("attention_bias", "mlp_bias"):
        if fields.flag(flag, False):
            raise SpecError(f"{source}:{flag}", config[flag], "models without biases only; must be false")
    if fields.text("hidden_act", "silu") != "silu":
        raise SpecError(f"{source}:hidden_act", config["hidden_act"], "SwiGLU needs silu")
    hidden, heads = fields.count("hidden_size"), fields.count("num_attention_heads")
    extra = {} if model_type == "llama" else spec_fields_of_family(fields, model_type)
    theta = rope.real("rope_theta", fields.real("rope_theta", 10000.0, minimum=0, above=True), minimum=0, above=True)
    name = fields.text("_name_or_path", f"hf-{model_type}").split("/")[-1] or f"hf-{model_type}"
    try:
        return ModelSpec(
            name=name, layers=fields.count("num_hidden_layers"), hidden=hidden, heads=heads,
            kv_heads=fields.count("num_key_value_heads", heads), head_dim=fields.count("head_dim", hidden // heads),
            ffn_hidden=fields.count("intermediate_size"), vocab=fields.count("vocab_size"),
            max_seq_len=fields.count("max_position_embeddings", 4096), rope_theta=theta,
            norm_eps=fields.real("rms_norm_eps", 1e-6, minimum=0, above=True),
            tied_embeddings=fields.flag("tie_word_embeddings", False), **extra)
    except SpecError as exc:  # a rule between fields: name the config's key, not fivefold's
        ours = exc.field.removeprefix("model.")
        if ours not in _HF_KEYS:
            raise
        key = "num_local_experts" if ours == "experts" and "num_experts" not in config else _HF_KEYS[ours]
        raise SpecError(f"{source}:{key}", config.get(key, exc.value), exc.fix) from None


def hf_config_from_spec(spec: ModelSpec) -> dict:
    """config.json content that transformers' from_pretrained reads as this model (Llama, Mixtral or Qwen3-MoE)."""
    family = family_of(spec)
    return {
        "vocab_size": spec.vocab, "hidden_size": spec.hidden, "intermediate_size": spec.ffn_hidden,
        "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_dim, "hidden_act": "silu",
        "max_position_embeddings": spec.max_seq_len, "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "tie_word_embeddings": spec.tied_embeddings, "attention_bias": False,
        "torch_dtype": "float32", "bos_token_id": None, "eos_token_id": None,
        **family_config(spec, family),
    }


# --- reading a Hugging Face folder ---------------------------------------------------------------

def read_hf_config(folder: Path) -> tuple[dict, ModelSpec]:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise SpecError("--from-hf", str(folder), f"no {CONFIG_FILE}; give a local Hugging Face model folder")
    try:
        config = json.loads(file.read_text())
    except ValueError as exc:  # also not UTF-8
        raise SpecError(str(file), "(unparsable)", f"not valid JSON ({str(exc)[:80]})") from None
    if not isinstance(config, dict):
        raise SpecError(str(file), type(config).__name__, "must be a JSON object of Llama config fields "
                                                         '(e.g. {"model_type": "llama", "hidden_size": 4096, ...})')
    return config, spec_from_hf_config(config, str(file))


def _weight_files(folder: Path) -> dict[Path, list[str] | None]:
    """Each safetensors file to read, with the tensor names the index promises in it (None: no index)."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            data = json.loads(index.read_text())
        except ValueError as exc:  # also not UTF-8
            raise SpecError(str(index), "(unparsable)", f"not valid JSON ({str(exc)[:80]})") from None
        weight_map = Fields(data, str(index)).table("weight_map")
        files: dict[Path, list[str]] = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or Path(shard).name != shard or not shard.endswith(".safetensors"):
                raise SpecError(f"{index}:weight_map.{name}", shard, "must name a .safetensors file in the same "
                                                                    "folder, e.g. model-00001-of-00002.safetensors")
            files.setdefault(folder / shard, []).append(name)
        for shard in files:
            if not shard.is_file():
                raise SpecError(str(shard), "missing", f"this shard is listed in {INDEX_FILE} but not in the folder")
        return dict(files)
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise SpecError("--from-hf", str(folder), f"no {SINGLE_FILE} or {INDEX_FILE} (only safetensors weights "
                                                  "are read)")
    return {single: None}


def _read_safetensors(file: Path, promised: list[str] | None) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(file))
    except SafetensorError as exc:
        raise SpecError(str(file), f"{file.stat().st_size} bytes",
                        f"truncated or not a safetensors file ({exc})") from None
    for name in promised or ():
        if name not in tensors:
            raise SpecError(str(file), name, f"{INDEX_FILE} places this tensor here, but the file lacks it")
    return tensors


def _expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    from fivefold.models import build_model

    model = build_model(spec)  # on meta: shapes only
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def load_hf_state_dict(folder: str | Path, dtype=None) -> tuple[ModelSpec, dict]:
    """(ModelSpec, state dict in fivefold names) of a local HF Llama/Mixtral/Qwen3-MoE folder; every tensor
    shape is checked against config.json. `dtype` (e.g. torch.float32) converts; None keeps the file's dtype."""
    import torch

    folder = Path(folder)
    config, spec = read_hf_config(folder)
    expected = _expected_shapes(spec)
    # HF name -> (fivefold name, expert index or None for a whole tensor)
    where: dict[str, tuple[str, int | None]] = {}
    for ours, theirs in hf_names(spec).items():
        for index, name in enumerate(theirs) if isinstance(theirs, list) else [(None, theirs)]:
            where[name] = (ours, index)
    state: dict = {}
    experts: dict[str, dict[int, object]] = {}
    for file, promised in _weight_files(folder).items():
        for hf_name, tensor in _read_safetensors(file, promised).items():
            if hf_name not in where:
                if hf_name.endswith("rotary_emb.inv_freq"):  # recomputed from rope_theta, not a weight
                    continue
                if _HF_LAYER_RE.match(hf_name) and int(_HF_LAYER_RE.match(hf_name).group(1)) >= spec.layers:
                    raise SpecError(f"{file}:{hf_name}", list(tensor.shape),
                                    f"{CONFIG_FILE} declares {spec.layers} layers; this tensor does not fit")
                raise SpecError(f"{file}:{hf_name}", list(tensor.shape),
                                f"not a weight of a {config.get('model_type')} model as {CONFIG_FILE} describes it")
            name, index = where[hf_name]
            shape = expected[name] if index is None else expected[name][1:]
            if tuple(tensor.shape) != shape:
                raise SpecError(f"{file}:{hf_name}", list(tensor.shape), f"{CONFIG_FILE} implies shape {list(shape)}")
            tensor = tensor if dtype is None else tensor.to(dtype)
            if index is None:
                state[name] = tensor
            else:
                experts.setdefault(name, {})[index] = tensor
    for name, pieces in experts.items():
        if len(pieces) == spec.experts:
            state[name] = torch.stack([pieces[e] for e in range(spec.experts)])
    if spec.tied_embeddings and "output.weight" not in state and "tok_embeddings.weight" in state:
        state["output.weight"] = state["tok_embeddings.weight"]
    missing = [n for n, theirs in where.items() if theirs[0] not in state]
    if missing:
        raise SpecError(str(folder), missing[0], f"weight missing from the safetensors files "
                                                 f"({len(missing)} missing in all)")
    return spec, state


# --- writing a Hugging Face folder -----------------------------------------------------------------

def save_hf(spec: ModelSpec, state_dict: dict, folder: str | Path) -> Path:
    """config.json + model.safetensors that transformers' from_pretrained loads (Llama, Mixtral or Qwen3-MoE)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    config = hf_config_from_spec(spec)
    expected = _expected_shapes(spec)
    names = hf_names(spec)
    tensors = {}
    for name, shape in expected.items():
        if spec.tied_embeddings and name == "output.weight":
            continue  # HF ties lm_head to embed_tokens itself; safetensors refuses shared storage
        tensor = state_dict.get(name)
        if tensor is None or tuple(tensor.shape) != shape:
            raise SpecError(f"state_dict:{name}", None if tensor is None else list(tensor.shape),
                            f"expected shape {list(shape)} for model {spec.name}")
        tensor = tensor.detach().to("cpu")
        if isinstance(names[name], list):  # stacked experts: one tensor per expert
            tensors.update({theirs: piece.contiguous() for theirs, piece in zip(names[name], tensor.unbind(0))})
        else:
            tensors[names[name]] = tensor.contiguous()
    dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values()}
    # "dtype" is the transformers 5 key, "torch_dtype" the one earlier versions read.
    config["dtype"] = config["torch_dtype"] = dtypes.pop() if len(dtypes) == 1 else "float32"
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / SINGLE_FILE), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return folder


# --- the convert verb ---------------------------------------------------------------------------------

def _require_empty(path: Path, flag: str) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise SpecError(flag, str(path), "exists and is not empty; choose a new directory")


def convert_from_hf(folder: str | Path, out: str | Path) -> Path:
    """A local HF Llama folder -> a fivefold checkpoint directory `out` (model only, step 0, fp32), with the
    folder's tokenizer files."""
    import torch

    from fivefold.checkpoint.layout import save_model_checkpoint

    from fivefold.checkpoint.tokenizer_files import copy_tokenizer_files

    out = Path(out)
    _require_empty(out, "--out")
    spec, state = load_hf_state_dict(folder, dtype=torch.float32)
    return save_model_checkpoint(state, spec, out, before_commit=lambda path: copy_tokenizer_files(folder, path))


def convert_to_hf(checkpoint: str | Path, out: str | Path) -> Path:
    """A fivefold checkpoint (folder or root of step folders) -> an HF Llama/Mixtral/Qwen3-MoE folder `out`, with
    the checkpoint's tokenizer files when it carries them."""
    from fivefold.checkpoint.layout import load_model_state_dict, read_checkpoint_info, resolve_checkpoint
    from fivefold.checkpoint.tokenizer_files import export_tokenizer
    from fivefold.models import build_model

    out = Path(out)
    _require_empty(out, "--out")
    path = resolve_checkpoint(checkpoint)
    spec = read_checkpoint_info(path)["model"]
    hf_config_from_spec(spec)  # refuse models no supported family holds before reading any weights
    model = build_model(spec)
    model.to_empty(device="cpu")
    load_model_state_dict(path, model)
    save_hf(spec, model.state_dict(), out)
    export_tokenizer(path, out, spec.max_seq_len)  # the checkpoint's tokenizer, when it carries one
    return out
