"""How prepared dataloaders split and deliver data."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Any

from packaging.version import Version

_TORCHDATA_MINIMUM = "0.11"
_TORCHDATA_HINT = "pip install 'lockstep[stateful]' (or pip install torchdata)"


def require_torchdata(where: str) -> Any:
    """torchdata's ``StatefulDataLoader`` class, or an ImportError that says how to install it.

    Args:
        where: what needs it, as the user wrote it (``DataLoaderConfiguration(use_stateful_dataloader=True)``).
    """
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError as error:
        raise ImportError(
            f"{where} needs torchdata>={_TORCHDATA_MINIMUM}, whose StatefulDataLoader cannot be imported ({error}). "
            f"Install it: {_TORCHDATA_HINT}; or leave use_stateful_dataloader=False (prepared loaders resume at the "
            "next unseen batch either way)."
        ) from error
    installed = _torchdata_version()
    if installed is not None and Version(installed) < Version(_TORCHDATA_MINIMUM):
        raise ImportError(
            f"{where} needs torchdata>={_TORCHDATA_MINIMUM} (lockstep reads its state format), and torchdata "
            f"{installed} is installed: pip install -U 'torchdata>={_TORCHDATA_MINIMUM}'."
        )
    return StatefulDataLoader


def _torchdata_version() -> str | None:
    try:
        return importlib.metadata.version("torchdata")
    except importlib.metadata.PackageNotFoundError:  # imported from a source tree
        return None


@dataclass(kw_only=True)
class DataLoaderConfiguration:
    """Settings for dataloaders passed to ``Accelerator.prepare``.

    Example:
        >>> config = DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True)
    """

    split_batches: bool = False
    """Split each batch of the original loader across processes (its batch size is then the global batch
    size and must be a multiple of the number of processes). When False each process gets whole batches
    of the original size, and the global batch is ``batch_size * num_processes``."""
    dispatch_batches: bool | None = None
    """Rank 0 reads every batch and sends each process its part. None means True for iterable datasets
    and False for map-style ones."""
    even_batches: bool = True
    """Give every process the same number of batches by repeating samples from the start of the epoch
    at the end. ``gather_for_metrics`` drops the repeats again."""
    use_seedable_sampler: bool = False
    """Shuffle with a sampler seeded by ``data_seed`` (or the global seed) plus the epoch, so that the
    order is the same on every rank and in every run; call ``set_epoch`` on the loader each epoch."""
    data_seed: int | None = None
    """Seed of the seedable sampler; None takes the current torch initial seed."""
    non_blocking: bool = False
    """Copy batches to the device asynchronously (needs ``pin_memory=True`` on the loader)."""
    use_stateful_dataloader: bool = False
    """Make prepared loaders torchdata ``StatefulDataLoader``s (needs ``pip install 'lockstep[stateful]'``).
    Every prepared loader resumes at the next unseen batch either way; this adds torchdata's state to the
    loader's ``state_dict``, so that datasets with a ``state_dict`` of their own (and the workers' copies of
    them) resume from it instead of being read again up to the saved batch."""

    def __post_init__(self) -> None:
        flags = (
            "split_batches",
            "even_batches",
            "use_seedable_sampler",
            "non_blocking",
            "use_stateful_dataloader",
        )
        for name in flags:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"DataLoaderConfiguration({name}={getattr(self, name)!r}) is invalid: it must be True or False."
                )
        if self.use_stateful_dataloader:
            require_torchdata("DataLoaderConfiguration(use_stateful_dataloader=True)")
