"""Where the weights come from: a local Hugging Face folder (--from-hf) or a fivefold checkpoint (--checkpoint),
read into (ModelSpec, state dict in fivefold names); plus the folder's tokenizer, chat template and end tokens."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from fivefold.errors import SpecError
from fivefold.spec import ModelSpec
from fivefold.spec.jsonfields import Fields


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
        try:
            self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # the tokenizers library raises its own Exception type for any bad file
            raise SpecError(str(path / "tokenizer.json"), "(unreadable)",
                            f"not a readable tokenizer.json ({str(exc)[:80]})") from None
        config = Fields(_read_json(path / "tokenizer_config.json"), str(path / "tokenizer_config.json"))
        template = config.data.get("chat_template")
        if (path / "chat_template.jinja").is_file():  # transformers >= 4.43 writes the template here
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # several named templates: the default one
            named = [Fields(t, f"{config.source}:chat_template[]") for t in template]
            template = next((t.text("template") for t in named if t.data.get("name") == "default"), None)
        if template is not None and not isinstance(template, str):
            raise config.fail("chat_template", template, "must be a string, or a list of {name, template}")
        self.template = template
        for name in ("bos_token", "eos_token"):
            value = config.data.get(name)
            if value is not None and not isinstance(value, (str, dict)):
                raise config.fail(name, value, "must be a string or an object with a content string")
        self.special = {name: _token_text(config.data.get(name)) for name in ("bos_token", "eos_token")}

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


def _read_json(file: Path) -> object:
    """A JSON file of the model folder, {} when absent; one line when it is not JSON."""
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except ValueError as exc:  # also not UTF-8
        raise SpecError(str(file), "(unparsable)", f"not valid JSON ({str(exc)[:80]})") from None


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
    return TextCodec(source.path)  # every unreadable file is one line naming it (TextCodec)
