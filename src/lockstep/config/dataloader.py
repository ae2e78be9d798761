"""How prepared dataloaders split and deliver data."""

from __future__ import annotations

from dataclasses import dataclass


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
    """Accepted for compatibility: every prepared loader of lockstep records its position already."""

    def __post_init__(self) -> None:
        for name in ("split_batches", "even_batches", "use_seedable_sampler", "non_blocking"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"DataLoaderConfiguration({name}={getattr(self, name)!r}) is invalid: it must be True or False."
                )
