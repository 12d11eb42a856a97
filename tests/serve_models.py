"""Tiny random Hugging Face folders for the serving tests (built locally, no download) and transformers' own
greedy generate as the reference."""

from __future__ import annotations

import json
from pathlib import Path

import torch

LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=1000.0,
             tie_word_embeddings=False, eos_token_id=95, bos_token_id=0)
MOE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts_per_tok=2,
           intermediate_size=64, moe_intermediate_size=24, num_experts=4, head_dim=16, norm_topk_prob=True,
           rope_theta=1000.0, eos_token_id=95, bos_token_id=0)


def save_model(folder: Path, family: str = "llama"):
    """A random model of `family` (llama or qwen3_moe) saved with save_pretrained; returns (model, folder)."""
    import transformers

    if family == "llama":
        config = transformers.LlamaConfig(**LLAMA)
    else:
        config = transformers.Qwen3MoeConfig(**MOE)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random norms and a wider router: sharper comparisons than HF's ones/zeros
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            if name.endswith("gate.weight") and param.shape[0] == 4:
                param.normal_(0.0, 0.5)
            if "embed_tokens" in name:
                param.normal_(0.0, 1.0)
    model.save_pretrained(folder)
    return model, folder


def prompts(count: int, seed: int = 0, shortest: int = 3, longest: int = 20) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (count,), generator=generator).tolist()
    return [torch.randint(1, 90, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' generate, greedy, one prompt alone (stops at the config's end token)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def write_prompts(path: Path, prompt_ids: list[list[int]]) -> Path:
    path.write_text("".join(json.dumps({"prompt_ids": ids}) + "\n" for ids in prompt_ids))
    return path


def read_outputs(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


WORDS = ["<s>", "<unk>", "user", "assistant", "system"] + [f"w{i}" for i in range(5, 95)] + ["</s>"]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}assistant"


def save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over the 96 ids ("<s>", "<unk>", "user", "assistant", "system", w5 ... w94,
    "</s>" = 95) with a chat template, saved as transformers saves one."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def words(ids: list[int]) -> str:
    """What the tokenizer of save_tokenizer decodes `ids` to (special tokens skipped)."""
    return " ".join(WORDS[i] for i in ids if i not in (0, 1, 95))
