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
    """The folder's tokenizer.json (the `tokenizers` library) and chat template (jinja2, rendered as transformers
    renders it: a sandbox, trim_blocks/lstrip_blocks, messages, bos/eos tokens, add_generation_prompt). Read
    directly rather than through transformers' AutoTokenizer, whose import takes seconds of a server's start."""

    def __init__(self, folder: str) -> None:
        from tokenizers import Tokenizer

        path = Path(folder)
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        config = {}
        if (path / "tokenizer_config.json").is_file():
            config = json.loads((path / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if (path / "chat_template.jinja").is_file():  # transformers >= 4.43 writes the template here
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # several named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.template = template
        self.special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")}

    def encode(self, text: str, special: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=special).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.template)

    def chat(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` under the chat template, ready for the assistant's answer."""
        if not self.template:  # no template: the turns as plain "role: content" lines, then the assistant's turn
            return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = raise_exception
        text = environment.from_string(self.template).render(messages=messages, add_generation_prompt=True,
                                                             **self.special)
        return self.encode(text, special=False)  # the template writes its own special tokens


def _token_text(value) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def open_codec(source: ModelSource) -> TextCodec | None:
    """The tokenizer of a Hugging Face folder that ships a tokenizer.json; None otherwise (token ids only)."""
    if source.kind != "hf":
        return None
    folder = Path(source.path)
    if not (folder / "tokenizer.json").is_file():
        return None  # (a sentencepiece-only folder: convert it with transformers to get a tokenizer.json)
    try:
        return TextCodec(source.path)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for a broken file
        raise SpecError("--from-hf", source.path, f"its tokenizer cannot be read ({str(exc)[:100]})") from None
