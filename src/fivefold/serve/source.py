"""Where the weights come from: a local Hugging Face folder (--from-hf) or a fivefold checkpoint (--checkpoint),
read into (ModelSpec, state dict in fivefold names); plus the folder's tokenizer, chat template and end tokens."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from fivefold.errors import SpecError
from fivefold.spec import ModelSpec


@dataclass(frozen=True)
class ModelSource:
    """A model folder as the CLI named it; cheap to pickle to the workers (they read the weights themselves)."""

    path: str
    kind: str  # "hf" or "checkpoint"
    spec: ModelSpec
    eos_ids: tuple[int, ...] = ()
    name: str = ""
    extra: dict = field(default_factory=dict)

    def load_state_dict(self) -> dict:
        """Every weight in fivefold names, fp32."""
        import torch

        if self.kind == "hf":
            from fivefold.checkpoint.hf import load_hf_state_dict

            return load_hf_state_dict(self.path, dtype=torch.float32)[1]
        from fivefold.checkpoint.layout import load_model_state_dict
        from fivefold.models import build_model

        model = build_model(self.spec)
        model.to_empty(device="cpu")
        load_model_state_dict(self.path, model)
        return dict(model.state_dict())


def _eos_ids(folder: Path, config: dict) -> tuple[int, ...]:
    """End tokens: generation_config.json first (what transformers' generate stops at), then config.json."""
    value = None
    generation = folder / "generation_config.json"
    if generation.is_file():
        try:
            value = json.loads(generation.read_text()).get("eos_token_id")
        except ValueError:
            value = None
    if value is None:
        value = config.get("eos_token_id")
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def open_source(from_hf: str | None, checkpoint: str | None) -> ModelSource:
    """The model of --from-hf or --checkpoint (exactly one), checked before any worker starts."""
    if bool(from_hf) == bool(checkpoint):
        raise SpecError("--from-hf/--checkpoint", from_hf or checkpoint,
                        "give exactly one: a local Hugging Face folder or a fivefold checkpoint")
    if from_hf:
        from fivefold.checkpoint.hf import read_hf_config

        folder = Path(from_hf)
        config, spec = read_hf_config(folder)
        return ModelSource(str(folder), "hf", spec, _eos_ids(folder, config), name=folder.name or str(folder))
    from fivefold.checkpoint.layout import read_checkpoint_info, resolve_checkpoint

    path = resolve_checkpoint(checkpoint)
    spec = read_checkpoint_info(path)["model"]
    return ModelSource(str(path), "checkpoint", spec, (), name=Path(checkpoint).name or str(path))


class TextCodec:
    """The folder's tokenizer (transformers' AutoTokenizer, from local files only) and its chat template."""

    def __init__(self, folder: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def chat(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` under the chat template, ready for the assistant's answer."""
        if self.has_chat_template:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        # No template: the turns as plain "role: content" lines, then the assistant's turn.
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return self.encode(text)


def open_codec(source: ModelSource) -> TextCodec | None:
    """The tokenizer of a Hugging Face folder that ships one; None otherwise (token ids only)."""
    if source.kind != "hf":
        return None
    folder = Path(source.path)
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json",
                                                      "tokenizer.model")):
        return None
    try:
        return TextCodec(source.path)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for a broken tokenizer folder
        raise SpecError("--from-hf", source.path, f"its tokenizer cannot be read ({str(exc)[:100]})") from None
