"""A ZeRO checkpoint resumed on another number of processes, through DeepSpeed's universal checkpoint.

DeepSpeed partitions ZeRO 1-3 optimizer state (and ZeRO-3 parameters) by the number of processes that
saved them, and its ordinary ``load_checkpoint`` reads them back on that number only. When the number of
processes changed, the main process converts engine ``i``'s files with DeepSpeed's own converter
(``deepspeed.checkpoint.ds_to_universal``: one file per parameter holding its fp32 master weights and
optimizer moments, unpartitioned) into a folder beside the checkpoint::

    ckpt/checkpoint_4/                       the checkpoint, only read: the last good one stays as it was
    ckpt/checkpoint_4.universal/deepspeed_0/engine/   the universal copy, while it is loaded

and every process then loads its new partition from it with the engine's universal loading (the config's
``checkpoint.load_universal`` key, switched on for this one load). Once every process has loaded it, the
copy is deleted: the next save writes an ordinary checkpoint on the new number of processes. The master weights and the moments come
back bit-equal: the conversion concatenates and slices fp32 tensors, it computes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
from pathlib import Path
from typing import Any

from lockstep.backends.deepspeed.checkpoint import TAG, engine_folder
from lockstep.errors import CheckpointError

UNIVERSAL_SUFFIX = ".universal"


def universal_root(folder: Path) -> Path:
    """The folder beside checkpoint ``folder`` that holds its universal conversion."""
    return folder.with_name(folder.name + UNIVERSAL_SUFFIX)


def convert(folder: Path, index: int, *, stage: int, saved_world: int, world: int) -> Path:
    """Convert engine ``index``'s files in checkpoint ``folder`` to a universal checkpoint beside it (on one
    process); returns the converted engine folder.

    Raises:
        CheckpointError: DeepSpeed could not convert the files (a shard missing, say). ``folder`` is left
            as it was and no partial conversion remains.
    """
    from deepspeed.checkpoint import ds_to_universal

    source = engine_folder(folder, index) / TAG
    target = engine_folder(universal_root(folder), index)
    shutil.rmtree(target, ignore_errors=True)  # a conversion left by an earlier resize is rebuilt
    arguments = argparse.Namespace(
        input_folder=str(source),
        output_folder=str(target / TAG),
        num_extract_workers=1,  # no process pool inside a training process
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # in memory only: a data-parallel model needs no layout info
    )
    chatter = io.StringIO()  # the converter prints its progress; kept for the error message
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            ds_to_universal.main(arguments)
    except Exception as error:
        discard(folder, index)
        raise CheckpointError(
            f"Checkpoint {folder} was saved by {saved_world} processes under ZeRO-{stage}, and this run has "
            f"{world}: converting it with DeepSpeed's ds_to_universal into {target} failed "
            f"({type(error).__name__}: {error}).{_cause(error)} The checkpoint was left as it was. Resume on "
            f"{saved_world} processes, or take the weights alone to any number with `lockstep merge-weights "
            f"{folder} OUT`."
        ) from error
    return target


ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def _cause(error: Exception) -> str:
    """What a converter failure means, when it is known (else nothing)."""
    if isinstance(error, KeyError) and error.args and error.args[0] in ADAM_MOMENTS:
        return (
            " DeepSpeed's universal checkpoints carry the fp32 master weights and Adam's two moments "
            "(exp_avg, exp_avg_sq) only, and this checkpoint's optimizer keeps other state (torch.optim.SGD's "
            "momentum, say): under ZeRO, an optimizer of the Adam family (Adam, AdamW) resumes on another number "
            "of processes, others only on the same number."
        )
    return ""


def discard(folder: Path, index: int) -> None:
    """Delete engine ``index``'s conversion beside checkpoint ``folder`` (and the folder beside it, once empty)."""
    shutil.rmtree(engine_folder(universal_root(folder), index), ignore_errors=True)
    with contextlib.suppress(OSError):  # only when no other engine's conversion is in it
        universal_root(folder).rmdir()


def load_universal(engine: Any, converted: Path) -> None:
    """Restore ``engine`` from the universal checkpoint ``converted`` (a collective)."""
    config = engine._config
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True  # read by the engine and its ZeRO optimizer during this load
    try:
        path, _ = engine.load_checkpoint(
            str(converted),
            tag=TAG,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
            load_module_strict=True,
        )
    finally:
        config.load_universal_checkpoint = before
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load the universal checkpoint in {converted}.")
