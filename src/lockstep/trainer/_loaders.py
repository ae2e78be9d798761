"""The Trainer's data loaders: built from the arguments, prepared once per dataset, cached."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from lockstep.accelerator import Accelerator
from lockstep.trainer import _hf_datasets
from lockstep.trainer._length_grouping import LengthGroupedSampler, dataset_lengths
from lockstep.trainer.arguments import TrainingArguments


class TrainerLoaders:
    """Makes and keeps the prepared loaders of one Trainer.

    Args:
        accelerator: prepares (shards) each loader.
        args: the loader settings (batch sizes, workers, sampling, drop_last...).
        collate: the collate function of every loader.
        keep_columns: the columns of a ``datasets`` object to keep (None: all).
        input_name: the model's main input, whose length ``group_by_length`` reads when the dataset has no
            ``length_column_name`` column.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        args: TrainingArguments,
        *,
        collate: Callable[[list[Any]], Any],
        keep_columns: list[str] | None,
        input_name: str = "input_ids",
    ) -> None:
        self.input_name = input_name
        self.accelerator = accelerator
        self.args = args
        self.collate = collate
        self.keep_columns = keep_columns
        self.train: DataLoader | None = None
        self._eval: dict[int, tuple[Any, DataLoader]] = {}

    def clear(self) -> None:
        """Forget every loader (the Accelerator forgot them too: ``free_memory``)."""
        self.train = None
        self._eval.clear()

    def build(self, dataset: Any, *, batch_size: int, train: bool, argument: str) -> DataLoader:
        """A plain (not prepared) loader of ``dataset``, as the arguments describe it."""
        args = self.args
        sampler = self._length_sampler(dataset, batch_size) if train else None
        dataset = _hf_datasets.remove_unused_columns(dataset, self.keep_columns, argument)
        iterable = isinstance(dataset, IterableDataset)
        workers = args.dataloader_num_workers
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=train and not iterable and args.train_sampling_strategy == "random",
            sampler=sampler,
            collate_fn=self.collate,
            drop_last=args.dataloader_drop_last if train else False,
            num_workers=workers,
            # Pinning needs an accelerator; on a CPU-only machine torch warns and ignores it.
            pin_memory=args.dataloader_pin_memory and self.accelerator.device.type != "cpu",
            persistent_workers=args.dataloader_persistent_workers,
            prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None,
            multiprocessing_context=args.dataloader_multiprocessing_context if workers > 0 else None,
        )

    def _length_sampler(self, dataset: Any, batch_size: int) -> LengthGroupedSampler | None:
        """The ``group_by_length`` sampler (groups sized for one optimizer step of one process), or None."""
        args = self.args
        if args.train_sampling_strategy != "group_by_length":
            return None
        if isinstance(dataset, IterableDataset):  # datasets.IterableDataset is one too
            raise ValueError(
                "TrainingArguments(train_sampling_strategy='group_by_length') needs a map-style train_dataset; "
                f"got the iterable {type(dataset).__name__}. Use 'random' or 'sequential'."
            )
        lengths = dataset_lengths(dataset, args.length_column_name, self.input_name)
        seed = args.data_seed if args.data_seed is not None else args.seed
        return LengthGroupedSampler(lengths, batch_size * args.gradient_accumulation_steps, seed)

    def train_loader(self, dataset: Any, batch_size: int) -> DataLoader:
        """The prepared training loader, made on the first call."""
        if self.train is None:
            loader = self.build(
                dataset, batch_size=batch_size, train=True, argument="Trainer(train_dataset=...)"
            )
            self.train = self.accelerator.prepare(loader)
        return self.train

    def eval_loader(self, dataset: Any, argument: str) -> DataLoader:
        """The prepared loader of ``dataset`` (as ``argument`` names it), made once per dataset."""
        cached = self._eval.get(id(dataset))
        if cached is None:
            _hf_datasets.check_dataset(dataset, argument)
            loader = self.build(
                dataset, batch_size=self.args.per_device_eval_batch_size, train=False, argument=argument
            )
            # The dataset is kept with its loader so that its id() is not reused by another object.
            cached = (dataset, self.accelerator.prepare(loader))
            self._eval[id(dataset)] = cached
        return cached[1]
