"""Checkpoints: the on-disk layout (DCP files + fivefold.json + manifest.json + COMMIT) and Hugging Face
Llama import/export."""

from fivefold.checkpoint.layout import (CheckpointWarning, checkpoint_problem, complete_checkpoints,
                                        finalize_checkpoint, load_model_state_dict, newest_checkpoint,
                                        prune_checkpoints, read_checkpoint_info, resolve_checkpoint,
                                        save_checkpoint, save_model_checkpoint, step_dir)

__all__ = ["CheckpointWarning", "checkpoint_problem", "complete_checkpoints", "finalize_checkpoint",
           "load_model_state_dict", "newest_checkpoint", "prune_checkpoints", "read_checkpoint_info",
           "resolve_checkpoint", "save_checkpoint", "save_model_checkpoint", "step_dir"]
