"""Checkpoints that lose nothing: layout, manifest, atomic commits, safe loading, model files, storage
(local folders, fsspec URLs, or a storage registered for a URL scheme with :func:`register_storage`)."""

from lockstep.checkpoint.disk_space import out_of_space_error
from lockstep.checkpoint.layout import (
    MANIFEST_NAME,
    CheckpointError,
    commit,
    newest_valid_checkpoint,
    prepare_staging,
    staging_dir_for,
    verify,
    write_manifest,
)
from lockstep.checkpoint.model_files import load_model_files, load_model_weights, save_model_files
from lockstep.checkpoint.safe_load import UnsafeCheckpointError, safe_torch_load
from lockstep.checkpoint.storage import (
    CheckpointStorage,
    Location,
    register_storage,
    registered_storages,
    storage_for,
    unregister_storage,
)
from lockstep.checkpoint.training_state import ACCELERATOR_STATE

__all__ = [
    "ACCELERATOR_STATE",
    "MANIFEST_NAME",
    "CheckpointError",
    "CheckpointStorage",
    "Location",
    "UnsafeCheckpointError",
    "commit",
    "load_model_files",
    "load_model_weights",
    "newest_valid_checkpoint",
    "out_of_space_error",
    "prepare_staging",
    "register_storage",
    "registered_storages",
    "safe_torch_load",
    "save_model_files",
    "staging_dir_for",
    "storage_for",
    "unregister_storage",
    "verify",
    "write_manifest",
]
