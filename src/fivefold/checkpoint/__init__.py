"""Checkpoints: the on-disk layout (DCP files + fivefold.json + manifest.json + COMMIT), what `fivefold train`
checks before resuming (resume.py), and Hugging Face Llama import/export. The worker side of training
checkpoints (async save, resharded load) is runtime/checkpointing.py."""

from fivefold.checkpoint.layout import (CheckpointWarning, checkpoint_problem, complete_checkpoints,
                                        finalize_checkpoint, load_model_state_dict, newest_checkpoint,
                                        prune_checkpoints, read_checkpoint_info, resolve_checkpoint,
                                        save_checkpoint, save_model_checkpoint, step_dir)

__all__ = ["CheckpointWarning", "checkpoint_problem", "complete_checkpoints", "finalize_checkpoint",
           "load_model_state_dict", "newest_checkpoint", "prune_checkpoints", "read_checkpoint_info",
           "resolve_checkpoint", "save_checkpoint", "save_model_checkpoint", "step_dir"]
