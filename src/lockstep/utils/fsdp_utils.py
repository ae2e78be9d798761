"""``accelerate.utils.fsdp_utils``: one model file from the shards an FSDP checkpoint holds.

Accelerate's other FSDP helpers (``save_fsdp_model``, ``load_fsdp_optimizer``...) are what its
``Accelerator.save_state`` calls for FSDP1; in lockstep ``save_state`` and ``load_state`` do that work (see
:mod:`lockstep.backends.fsdp.checkpoint`), so they are not provided.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path

from lockstep.checkpoint.model_files import save_model_files
from lockstep.checkpoint.saver import agree
from lockstep.state import PartialState

__all__ = ["merge_fsdp_weights"]

_logger = logging.getLogger(__name__)


def merge_fsdp_weights(
    checkpoint_dir: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    safe_serialization: bool = True,
    remove_checkpoint_dir: bool = False,
) -> None:
    """Merge the shards of a ``SHARDED_STATE_DICT`` checkpoint into one model, as ``lockstep merge-weights``.

    Runs on the main process (the others wait), with or without a process group: the checkpoint's
    metadata gives every tensor's global shape, and the shards of all processes are read into whole
    tensors. The model is written into ``output_path`` like ``save_model``: ``model.safetensors`` (or
    ``pytorch_model.bin``), split into 10GB shards with an index when larger.

    Args:
        checkpoint_dir: the model's DCP folder (``pytorch_model_fsdp_0``), or the ``save_state`` folder
            holding it (model 0 is merged).
        output_path: the folder to write into; created if missing.
        safe_serialization: write safetensors; False writes ``torch.save`` ``.bin`` files.
        remove_checkpoint_dir: delete ``checkpoint_dir`` afterwards.

    Raises:
        FileNotFoundError: ``checkpoint_dir`` is not a sharded checkpoint.

    Example:
        >>> merge_fsdp_weights("ckpt/pytorch_model_fsdp_0", "merged")  # doctest: +SKIP
    """
    state = PartialState()
    error: Exception | None = None
    if state.is_main_process:
        try:
            _merge(Path(checkpoint_dir), output_path, safe_serialization, remove_checkpoint_dir)
        except Exception as caught:
            error = caught
    # Every rank learns whether the main process succeeded, instead of waiting at a barrier it never reaches.
    agree(state, error, "merge_fsdp_weights")


def _merge(
    source: Path, output_path: str | os.PathLike[str], safe_serialization: bool, remove_checkpoint_dir: bool
) -> None:
    # Here, not at the top: the backends (and torch's FSDP) are not needed to import lockstep.utils.
    from lockstep.backends.fsdp.checkpoint import read_full_weights, sharded_model_folder

    if not source.is_dir():
        raise FileNotFoundError(
            f"merge_fsdp_weights({str(source)!r}): no such folder. Pass the folder save_state wrote, or its "
            "pytorch_model_fsdp_N subfolder."
        )
    folder = sharded_model_folder(source)
    with warnings.catch_warnings():
        # Reading every shard in this one process is the intent; torch warns about it on each call.
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        weights = read_full_weights(folder)
    written = save_model_files(weights, output_path, safe_serialization=safe_serialization)
    _logger.info("Merged %d tensors from %s into %s", len(weights), folder, written[0].parent)
    if remove_checkpoint_dir:
        shutil.rmtree(source)
