"""fivefold: plan, predict and run hybrid-parallel transformer training."""

__version__ = "0.1.0"


def load_pretrained(path: str, device: str = "cpu"):
    """A ready model (eval mode, fp32) from a fivefold checkpoint (a step folder or a root of them) or a
    local Hugging Face Llama, Mixtral or Qwen3-MoE folder; `model(input_ids)` returns logits [batch, seq, vocab].

    torch is imported here, not at package import, so planning works without PyTorch.
    """
    from pathlib import Path

    import torch

    from fivefold.checkpoint.hf import CONFIG_FILE, load_hf_state_dict
    from fivefold.checkpoint.layout import load_model_state_dict, read_checkpoint_info, resolve_checkpoint
    from fivefold.models import build_model

    if (Path(path) / CONFIG_FILE).is_file():
        spec, state = load_hf_state_dict(path, dtype=torch.float32)
        model = build_model(spec)
        model.to_empty(device=device)
        model.load_state_dict(state)
    else:
        checkpoint = resolve_checkpoint(path)
        model = build_model(read_checkpoint_info(checkpoint)["model"])
        model.to_empty(device=device)
        load_model_state_dict(checkpoint, model)
    return model.eval()
