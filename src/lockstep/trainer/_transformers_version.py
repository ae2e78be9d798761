"""Which transformers is installed, and the ``TrainingArguments`` defaults that follow it.

lockstep's ``TrainingArguments`` takes the installed transformers' defaults where versions differ, so that a
script gives transformers.Trainer's results with the same arguments; without transformers, transformers
5.24's. The version is read from the package metadata: transformers itself is not imported.

Defaults that differ between the versions lockstep supports (4.40 to 5.x):

* ``optim``: ``"adamw_torch"`` before transformers 4.54; from 4.54 ``"adamw_torch_fused"`` with torch >= 2.8
  (https://github.com/huggingface/transformers/pull/37358), else ``"adamw_torch"``.

Fields of transformers 4 that transformers 5 removed are lockstep fields whatever the version
(``overwrite_output_dir``, ``evaluation_strategy``, ``use_legacy_prediction_loop``, ``save_safetensors``,
``tpu_metrics_debug``): scripts written for 4.x read or pass them.
"""

from __future__ import annotations

import re
from importlib import metadata

WITHOUT_TRANSFORMERS = (5, 24)
"""The transformers version whose defaults apply when transformers is not installed."""

FUSED_ADAMW_DEFAULT_SINCE = (4, 54)
"""The first transformers whose default optimizer is fused AdamW (with torch >= 2.8)."""


def _version(package: str) -> tuple[int, int] | None:
    try:
        text = metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def transformers_version() -> tuple[int, int]:
    """(major, minor) of the installed transformers; :data:`WITHOUT_TRANSFORMERS` when there is none."""
    return _version("transformers") or WITHOUT_TRANSFORMERS


def default_optim(transformers: tuple[int, int], torch: tuple[int, int] | None) -> str:
    """transformers' default ``optim`` for that transformers and torch version.

    Example:
        >>> default_optim((4, 40), (2, 13)), default_optim((5, 24), (2, 13)), default_optim((5, 24), (2, 7))
        ('adamw_torch', 'adamw_torch_fused', 'adamw_torch')
    """
    fused = transformers >= FUSED_ADAMW_DEFAULT_SINCE and torch is not None and torch >= (2, 8)
    return "adamw_torch_fused" if fused else "adamw_torch"


DEFAULT_OPTIM = default_optim(transformers_version(), _version("torch"))
"""The default ``optim`` of this installation."""
