"""``num_items_in_batch`` and ``average_tokens_across_devices``, with transformers' Trainer's semantics.

When the loss can be normalised by a count the Trainer gives -- a model whose ``forward`` takes loss keyword
arguments (transformers models: ``accepts_loss_kwargs``, else a ``**kwargs`` in ``forward``), a
``compute_loss_func``, or ``label_smoothing_factor`` -- the Trainer reads a whole accumulation cycle ahead and
counts its labels that are not -100 (over ``labels[..., 1:]`` for causal LMs, whose loss shifts them). With
``average_tokens_across_devices`` (the default) the count is summed over the data-parallel processes. It is
passed as ``num_items_in_batch`` (to the model's forward and to the loss function), so each micro-batch loss is
``sum of its token losses / num_items_in_batch``. That loss is multiplied by the number of data-parallel
replicas (DDP averages gradients) and, with context parallelism, by ``cp_size`` (FSDP averages the gradients of
the ranks that hold the chunks of one sequence), and is not divided by the accumulation steps: the optimizer sees
the gradient of the mean over every label token of the step, whatever the number of processes and micro-batches.
A batch that holds ``shift_labels`` (labels shifted already) is counted over those.

A ``compute_loss_func`` must therefore divide by ``num_items_in_batch`` (as in transformers); one that returns
a per-batch mean gets its gradient multiplied by the processes and micro-batches, as in transformers.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from lockstep.backends import JointPreparation
from lockstep.trainer import _process_setup, batches

IGNORE_INDEX = -100


class MicroBatch(NamedTuple):
    """One batch of the training loader, with the label count of its accumulation cycle."""

    batch: Any
    num_items: torch.Tensor | None
    """The cycle's label count (the whole job's with ``average_tokens_across_devices``); None when the loss
    is not normalised by it (no counter, or a batch without a labels tensor)."""
    last: bool
    """Whether the batch ends its accumulation cycle (gradients synchronise and the optimizer steps)."""


def accepts_loss_kwargs(model: nn.Module) -> bool:
    """Whether ``model``'s forward takes ``num_items_in_batch`` (transformers' rule)."""
    declared = getattr(model, "accepts_loss_kwargs", None)
    if declared is not None:
        return bool(declared)
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def loss_shifts_labels(model: nn.Module) -> bool:
    """Whether the model's loss shifts its labels (decoder-only causal LMs): position 0 is never a target."""
    causal = getattr(model, "loss_type", None) == "ForCausalLM" or type(model).__name__.endswith(
        "ForCausalLM"
    )
    encoder_decoder = getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    return causal and not encoder_decoder


class ItemCounter:
    """Counts the label tokens of an accumulation cycle (``num_items_in_batch``).

    Args:
        accelerator: sums the count over the data-parallel replicas.
        label_names: where the labels are in a batch.
        shift: count ``labels[..., 1:]`` (causal LMs).
        across_devices: sum over the processes (``average_tokens_across_devices``).
        replicas: the data-parallel replicas; the loss is multiplied by them when ``across_devices``.
        sequence_shards: the ranks each sequence is split over (``cp_size``); the loss is multiplied by them.
    """

    def __init__(
        self,
        accelerator: Any,
        *,
        label_names: Sequence[str],
        shift: bool,
        across_devices: bool,
        replicas: int,
        sequence_shards: int = 1,
    ) -> None:
        self.accelerator = accelerator
        self.label_names = list(label_names)
        self.shift = shift
        self.across_devices = across_devices
        self.loss_scale = (replicas if across_devices else 1) * sequence_shards

    def count(self, cycle: Sequence[Any]) -> torch.Tensor | None:
        """The label count of ``cycle`` (None when its batches hold no labels tensor)."""
        total = None
        for batch in cycle:
            _, labels = batches.split_labels(batch, self.label_names, pop=False)
            if not isinstance(labels, torch.Tensor):
                return None
            counted = labels[..., 1:] if self.shift else labels
            if isinstance(batch, Mapping) and isinstance(batch.get("shift_labels"), torch.Tensor):
                counted = batch["shift_labels"]  # shifted already (a packing collator's)
            items = counted.ne(IGNORE_INDEX).sum().to(self.accelerator.device)
            total = items if total is None else total + items
        if total is not None and self.across_devices:
            # Every rank holds a cycle of the same length (the loaders are even), so all of them reach this.
            total = self.accelerator.reduce(total, reduction="sum")
        return total


def micro_batches(loader: Iterable[Any], counter: ItemCounter | None, steps: int) -> Iterator[MicroBatch]:
    """The loader's batches: read a cycle of ``steps`` ahead and counted when there is a ``counter``."""
    if counter is None:
        for batch in loader:
            yield MicroBatch(batch, None, False)
        return
    iterator = iter(loader)
    while cycle := list(itertools.islice(iterator, steps)):
        items = counter.count(cycle)
        for index, batch in enumerate(cycle):
            yield MicroBatch(batch, items, index == len(cycle) - 1)


@contextlib.contextmanager
def counted_micro_step(accelerator: Any, model: nn.Module, micro: MicroBatch) -> Iterator[None]:
    """The accumulation context of a read-ahead cycle (``accelerate()`` would see the loader's end too early):
    gradients synchronise on the cycle's last batch only (on every batch with the plugin's
    ``sync_each_batch``, as ``accumulate`` does); a counted loss is not divided by the steps."""
    accelerator.sync_gradients = micro.last
    steps = accelerator.gradient_accumulation_steps
    with contextlib.ExitStack() as stack:
        if not micro.last and not accelerator.gradient_state.sync_each_batch:
            stack.enter_context(accelerator.no_sync(model))
        if micro.num_items is not None:
            accelerator.gradient_accumulation_steps = 1
            stack.callback(setattr, accelerator, "gradient_accumulation_steps", steps)
        yield


def item_counter(
    accelerator: Any, model: nn.Module, args: Any, *, loss_func: Any, label_names: Sequence[str]
) -> ItemCounter | None:
    """The plain training step's counter, or None when the loss is a per-batch mean averaged over micro-batches
    and processes (a model without loss keyword arguments and no loss function; DeepSpeed, whose engine scales
    the loss by the accumulation steps itself). A pipeline's step has none: its loss is a mean per micro-batch."""
    if accelerator.capability(JointPreparation) is not None:
        return None
    if loss_func is None and not accepts_loss_kwargs(model):
        return None
    _, replicas = _process_setup.data_parallel_share(accelerator)
    return ItemCounter(
        accelerator,
        label_names=label_names,
        shift=loss_shifts_labels(model),
        across_devices=args.average_tokens_across_devices,
        replicas=replicas,
        sequence_shards=_process_setup.sequence_shards(accelerator),
    )
