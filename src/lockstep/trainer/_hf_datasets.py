"""Hugging Face ``datasets`` objects as Trainer inputs; ``datasets`` is imported only when given one.

* A ``datasets.Dataset`` is map-style (``__getitem__``/``__len__``), in any of the formats the collator
  understands: plain python values, ``set_format("torch")``, ``set_format("numpy")``, or a transform
  (``set_transform``/``with_transform``).
* A ``datasets.IterableDataset`` is a torch ``IterableDataset`` (so ``max_steps`` is needed); the
  prepared loader forwards ``set_epoch`` to it, so a ``.shuffle(seed=...)`` stream changes order per epoch.
* With ``remove_unused_columns`` the columns the model's forward does not accept are removed from the
  dataset itself (``dataset.remove_columns``), as transformers does: they are never read or converted
  (a text column next to ``input_ids`` would otherwise reach the collator). Labels (``label_names``,
  ``label``, ``label_ids``) are kept; the collator renames ``label``/``label_ids`` to ``labels``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from torch.utils.data import IterableDataset

logger = logging.getLogger("lockstep.trainer")

# Formats whose examples the collator can stack; "custom" is a user transform (set_transform).
_COLLATABLE_FORMATS = (None, "python", "torch", "numpy", "custom")


def _from_package(obj: Any, package: str) -> bool:
    """Whether ``obj``'s class (or a base) is defined in ``package``: tells without importing it."""
    return any(cls.__module__.partition(".")[0] == package for cls in type(obj).__mro__)


def is_hf_dataset(obj: Any) -> bool:
    """Whether ``obj`` comes from the Hugging Face ``datasets`` package."""
    return _from_package(obj, "datasets")


def _format_type(dataset: Any) -> str | None:
    if hasattr(dataset, "format"):  # datasets.Dataset
        return dataset.format.get("type")
    formatting = getattr(dataset, "_formatting", None)  # datasets.IterableDataset
    return getattr(formatting, "format_type", None)


def _check_hf_dataset(dataset: Any, argument: str) -> None:
    import datasets  # already imported: the object comes from it

    if isinstance(dataset, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        splits = list(dataset)
        example = splits[0] if splits else "train"
        raise TypeError(
            f"{argument} got a {type(dataset).__name__} with the splits {splits}: pass one split, e.g. "
            f"dataset[{example!r}]."
        )
    if not isinstance(dataset, (datasets.Dataset, datasets.IterableDataset)):
        raise TypeError(
            f"{argument} got a datasets.{type(dataset).__name__}: pass a datasets.Dataset or "
            "datasets.IterableDataset (one split)."
        )
    kind = _format_type(dataset)
    if kind not in _COLLATABLE_FORMATS:
        raise ValueError(
            f"{argument} is a {type(dataset).__name__} formatted as {kind!r}: the Trainer collates examples "
            "of python values, NumPy arrays or torch tensors. Call dataset.with_format('torch') (or "
            "dataset.with_format(None))."
        )


def check_dataset(dataset: Any, argument: str) -> None:
    """Raise a clear error when ``dataset`` cannot feed a DataLoader.

    Args:
        dataset: what the user passed (None is allowed: no such set).
        argument: how the user passed it, for the message, e.g. ``"Trainer(train_dataset=...)"``.
    """
    if dataset is None:
        return
    if is_hf_dataset(dataset):
        _check_hf_dataset(dataset, argument)
        return
    if _from_package(dataset, "pandas"):
        raise TypeError(
            f"{argument} got a pandas {type(dataset).__name__}, whose [] selects columns, not examples: "
            "convert it with datasets.Dataset.from_pandas(df)."
        )
    if isinstance(dataset, Mapping):
        raise TypeError(
            f"{argument} got a {type(dataset).__name__} (keys {list(dataset)[:5]}), not a dataset of examples. "
            "For a dict of columns, pass datasets.Dataset.from_dict(columns)."
        )
    if isinstance(dataset, (str, bytes, os.PathLike)):
        raise TypeError(
            f"{argument} got the path {dataset!r}, not a dataset: load it first, e.g. "
            "datasets.load_dataset('csv', data_files=path)['train']."
        )
    if isinstance(dataset, IterableDataset):
        return
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise TypeError(
            f"{argument} got a {type(dataset).__name__}, which is neither map-style (__getitem__ and __len__, "
            "e.g. a torch Dataset or datasets.Dataset) nor a torch IterableDataset. Wrap a generator with "
            "datasets.IterableDataset.from_generator(fn), or subclass torch.utils.data.IterableDataset."
        )


def remove_unused_columns(dataset: Any, keep: Sequence[str] | None, argument: str) -> Any:
    """``dataset`` without its columns that are not in ``keep``.

    Only Hugging Face datasets whose columns are known are trimmed; other datasets (and a dataset with a
    transform, which may need every column) come back unchanged, and the collator drops the keys of their
    examples that the model does not accept.

    Args:
        dataset: the training or evaluation set.
        keep: the model's forward arguments and the label names; None keeps every column.
        argument: how the user passed the dataset, for the message.
    """
    if keep is None or not is_hf_dataset(dataset) or _format_type(dataset) == "custom":
        return dataset
    columns = list(getattr(dataset, "column_names", None) or [])
    unused = [column for column in columns if column not in keep]
    if not unused:
        return dataset
    if len(unused) == len(columns):
        raise ValueError(
            f"{argument}: none of the dataset's columns {columns} is an argument of the model's forward or a "
            f"label name (accepted: {sorted(set(keep))}). Rename a column (dataset.rename_column(old, new)), "
            "or set TrainingArguments(remove_unused_columns=False) to pass every column."
        )
    logger.info("%s: removing the columns the model's forward does not accept: %s", argument, unused)
    return dataset.remove_columns(unused)
