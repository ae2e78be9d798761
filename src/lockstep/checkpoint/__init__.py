"""Checkpoints that lose nothing: layout, manifest, atomic commits, safe loading, model files."""

from lockstep.checkpoint.layout import CheckpointError, newest_valid_checkpoint, verify
from lockstep.checkpoint.model_files import load_model_files, load_model_weights, save_model_files
from lockstep.checkpoint.safe_load import UnsafeCheckpointError, safe_torch_load

__all__ = [
    "CheckpointError",
    "UnsafeCheckpointError",
    "load_model_files",
    "load_model_weights",
    "newest_valid_checkpoint",
    "safe_torch_load",
    "save_model_files",
    "verify",
]
