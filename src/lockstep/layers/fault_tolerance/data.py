"""Each step's batches dealt over the replica groups of that step's quorum, so that no sample is lost.

A prepared loader of a fault-tolerant job does not read a fixed 1/N of the data. The epoch's order is a list
of *global batches* (the user's ``BatchSampler`` over the same, seeded, order on every group); the loader's
position is ``consumed``, the global batches of the epoch that committed steps used, the same on every group.
At the first batch of a step the group joins the step's quorum (healing from a live peer first when it is
behind), learns the participants ``P`` and its rank ``r`` among them, and reads global batch
``consumed + r`` (its k-th micro-batch of the step under gradient accumulation: ``consumed + k * P + r``).
When the step commits, ``consumed`` grows by ``P`` per micro-batch; when torchft does not commit it, nothing
moves and the same samples are dealt again, over the next step's participants. So every sample of the
epoch is used by exactly one committed step, whichever groups come and go.

The last step of an epoch can have fewer global batches left than participants: a group with none left reads
one from the epoch's start (``padded`` in its draw record), as ``even_batches`` repeats samples across
processes, so that every participant has a batch and none ends its epoch alone.

The loop that reads the loader has an epoch of its own: ``set_epoch(e)`` names it, else each iteration
counts one from where the first began. A group that heals from a live peer takes the peer's epoch and
position, usually far ahead of its own loop (a relaunched group's loop starts at epoch 0 while the job is in
epoch 112). So an iteration of a loop epoch that the job's history has passed reads nothing, with a warning,
and the loop epoch that meets the history continues from the healed position: the ordinary loop
``for epoch in range(num_epochs): [train_dl.set_epoch(epoch)]; for batch in train_dl: ...`` trains, on a
healed group, exactly the batches its peers still train, and ends with them.

An *evaluation pass* is an iteration that starts while every prepared model is in eval mode
(``model.eval()``): no step of it is trained, so it is not dealt over a quorum. Each group reads the whole
epoch, dealt over its own processes as a loader without fault tolerance deals it (``even_batches``, with
``remainder`` set), so ``gather_for_metrics`` within the group returns every sample once, and a group lost
meanwhile takes nothing from the others' metrics. The pass leaves the loader's position as it was.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, final

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from lockstep._nested import send_to_device
from lockstep.data.samplers import SeedableRandomSampler, global_batches, process_share
from lockstep.state import GradientState

logger = logging.getLogger("lockstep.layers")
DEFAULT_DATA_SEED = 0
"""Shuffling seed of every group when ``DataLoaderConfiguration(data_seed=...)`` is not set: the groups must
draw the same order, and a seed of each process's own would differ."""

Quorum = Callable[[], tuple[int, int]]
"""Joins the current step's quorum (once per step); returns (participants, this group's rank among them)."""


@dataclass(frozen=True)
class GroupReading:
    """How a loader reads an evaluation pass inside its replica group.

    Attributes:
        evaluating: whether an iteration starting now is an evaluation pass (every prepared model in eval
            mode).
        process: this process's index in its group.
        processes: the processes of the group.
        even_batches: repeat samples from the epoch's start so that every process of the group reads as many
            batches (``DataLoaderConfiguration(even_batches=...)``).
    """

    evaluating: Callable[[], bool] = lambda: False
    process: int = 0
    processes: int = 1
    even_batches: bool = True


@final
class StepBatches:
    """The batch sampler of a fault-tolerant loader: each step's global batches over its participants.

    Args:
        batch_sampler: the user's batch sampler (its order must be the same on every group).
        quorum: joins the step's quorum; (participants, rank).
        groups: the replica groups the job starts with (only for ``len``).
        reading: how an evaluation pass is read inside the group.

    Attributes:
        groups: the replica groups the job starts with.
        epoch: the epoch read now (or next): the job's history, the same on every group.
        consumed: global batches of that epoch consumed by committed steps.
        loop_epoch: the epoch of the loop that reads this loader (``set_epoch``, else counted per iteration;
            None before the first): an iteration with ``loop_epoch < epoch`` reads nothing.
        last: the last draw: ``epoch``, ``consumed``, ``participants``, ``rank``, ``batch`` (its global
            index), ``ids``, ``padded`` (a repeat from the epoch's start); None before the first.
        evaluation_pass: an evaluation pass is being read.
        remainder: real samples in the last round of the evaluation pass being read (-1 otherwise).
    """

    def __init__(
        self, batch_sampler: Any, quorum: Quorum, groups: int, reading: GroupReading | None = None
    ) -> None:
        self.batch_sampler = batch_sampler
        self._quorum = quorum
        self.groups = groups
        self.reading = GroupReading() if reading is None else reading
        self.evaluation_pass = False
        self.remainder = -1
        self._steps_ended = 0
        self._warned = False
        self.epoch = 0
        self.consumed = 0
        self.drawn = 0
        """Batches this group drew in the current step (uncommitted)."""
        self.participants = 0
        self.rank = 0
        self.end = False
        self.last: dict[str, Any] | None = None
        self.loop_epoch: int | None = None
        self._order: tuple[int, Sequence[Sequence[int]]] | None = None
        self._broken = False
        self._from_peer = False
        self._skips_reported = -1

    def _global(self) -> Sequence[Sequence[int]]:
        """The epoch's global batches (drawn once per epoch, seeded by the epoch)."""
        if self._order is None or self._order[0] != self.epoch:
            holder = self.batch_sampler
            for target in (holder, getattr(holder, "sampler", None)):
                if hasattr(target, "set_epoch"):
                    target.set_epoch(self.epoch)  # type: ignore[union-attr]
                    break
            self._order = (self.epoch, global_batches(holder))
        return self._order[1]

    def __len__(self) -> int:
        """Steps of a whole epoch with every group present (fewer groups take more steps)."""
        return -(-len(self.batch_sampler) // self.groups)

    def step_ended(self, committed: bool) -> None:
        """The step's commit decision: a committed step consumes what its participants drew."""
        if committed:
            self.consumed += self.drawn * self.participants
        self.drawn = 0
        self._steps_ended += 1

    def __iter__(self) -> Iterator[list[int]]:
        if self.reading.evaluating():
            yield from self._evaluation_pass()
            return
        if self.loop_epoch is None:
            self.loop_epoch = self.epoch
        if self.loop_epoch < self.epoch:  # the history passed this loop epoch (a healed group)
            self._skip_loop_epoch()
            return
        if (
            self._broken
        ):  # an earlier iteration was broken off: a new one starts the epoch, as a DataLoader does
            self.consumed, self.drawn, self._broken = 0, 0, False
        self._broken, self._steps_ended, self.remainder = True, 0, -1
        read = 0
        while (ids := self._draw()) is not None:
            read += 1
            yield ids
        self._broken = False
        self.epoch, self.consumed, self.drawn, self._order = self.epoch + 1, 0, 0, None
        self.loop_epoch += 1
        if read and self._steps_ended == 0:
            self._warn_unstepped_pass()

    def set_loop_epoch(self, epoch: int) -> None:
        """The loop reads epoch ``epoch`` next (``set_epoch``): ahead of the history, the history jumps there
        (from its start); at the history's epoch, it continues where the history stands (a resumed or healed
        position); behind it, the iteration reads nothing."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"set_epoch({epoch!r}) is invalid: pass the loop's epoch, an int >= 0.")
        self.loop_epoch = epoch
        if epoch > self.epoch:
            self.epoch, self.consumed, self.drawn, self._broken = epoch, 0, 0, False

    def _skip_loop_epoch(self) -> None:
        assert self.loop_epoch is not None
        if self._skips_reported != self.epoch:  # once per heal, not once per skipped epoch
            self._skips_reported = self.epoch
            passed = (
                f"{self.loop_epoch}"
                if self.loop_epoch == self.epoch - 1
                else f"{self.loop_epoch}-{self.epoch - 1}"
            )
            logger.warning(
                "this replica group stands at epoch %d of the job (it healed from a live peer) while the loop "
                "reading this loader is at epoch %d: the others trained epochs %s already, so the loop's "
                "iterations for them read nothing here, and its epoch %d continues where the job stands",
                self.epoch,
                self.loop_epoch,
                passed,
                self.epoch,
            )
        self.loop_epoch += 1

    def _evaluation_pass(self) -> Iterator[list[int]]:
        """The whole epoch, dealt over this group's processes (see the module doc)."""
        reading = self.reading
        plan = process_share(
            self._global(),
            self.batch_sampler,
            process=reading.process,
            processes=reading.processes,
            even_batches=reading.even_batches,
        )
        self.evaluation_pass, self.remainder, self.end = True, plan.remainder, False
        try:
            for index, ids in enumerate(plan):
                self.end = index == len(plan) - 1
                yield ids
        finally:  # after the last batch's gather_for_metrics, before any other iteration's batch
            self.evaluation_pass, self.remainder = False, -1

    def _warn_unstepped_pass(self) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            "A prepared loader of a fault-tolerant job was read to its end without an optimizer step while a "
            "prepared model was in training mode, so it was dealt over the replica groups: each group read "
            "only its share, and gather_for_metrics returns that share. Call model.eval() before an "
            "evaluation loop: every group then reads the whole set and gathers all of it.",
            stacklevel=3,
        )

    def _draw(self) -> list[int] | None:
        if self.drawn == 0:
            if self.consumed >= len(self._global()):
                return None
            self.participants, self.rank = self._quorum()  # may heal: epoch and consumed from the peer
        batches = self._global()
        total, start = len(batches), self.consumed + self.drawn * self.participants
        if start >= total:
            return None
        index = start + self.rank
        ids = [int(i) for i in batches[index % total]]
        self.end, self.drawn = start + self.participants >= total, self.drawn + 1
        self.last = {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "participants": self.participants,
            "rank": self.rank,
            "batch": index,
            "ids": ids,
            "padded": index >= total,
        }
        logger.debug("fault tolerance draw %s", self.last)
        return ids

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "global_batches": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The position of a checkpoint (the loop resumes with it), or, while :meth:`receiving_from_peer`,
        of a live peer (the loop keeps its own epoch; one that has not begun counts from this group's epoch
        before the heal)."""
        if self._from_peer:
            if self.loop_epoch is None:
                self.loop_epoch = self.epoch
        else:
            self.loop_epoch = None
        self.epoch, self.consumed, self.drawn = int(state["epoch"]), int(state["global_batches"]), 0
        self._broken = False  # the next iteration continues from there

    @contextlib.contextmanager
    def receiving_from_peer(self) -> Iterator[None]:
        """While inside, a loaded position is a live peer's (a heal), not a checkpoint's."""
        self._from_peer = True
        try:
            yield
        finally:
            self._from_peer = False


@final
class QuorumDataLoader(DataLoader):
    """A prepared loader of a fault-tolerant job (see the module doc); built by the backend at ``prepare``.

    Args:
        dataset: the user's map-style dataset.
        batches: the step-wise batch sampler.
        device: move each batch there (None: leave it).
        **settings: the user's ``collate_fn``, ``pin_memory``, ...
    """

    def __init__(
        self, dataset: Any, *, batches: StepBatches, device: torch.device | None, **settings: Any
    ) -> None:
        super().__init__(dataset, batch_sampler=batches, num_workers=0, **settings)
        self.steps = batches
        self.device = device
        self.end_of_dataloader = False

    @property
    def gradient_state(self) -> GradientState:
        return GradientState()

    @property
    def remainder(self) -> int:
        """Real samples in the last round of the evaluation pass being read (-1 otherwise: training steps
        are dealt over the quorum, with no repeats to cut)."""
        return self.steps.remainder

    def __iter__(self) -> Iterator[Any]:
        self.end_of_dataloader = False
        self.gradient_state._add_dataloader(self)
        try:
            for batch in super().__iter__():
                self.end_of_dataloader = self.steps.end
                yield batch if self.device is None else send_to_device(batch, self.device)
        finally:
            self.gradient_state._remove_dataloader(self)

    def set_epoch(self, epoch: int) -> None:
        """The loop reads epoch ``epoch`` next: an epoch ahead of the job's history starts there; the
        history's own epoch continues where it stands (after a resume or a heal); an epoch the history passed
        reads nothing (:meth:`StepBatches.set_loop_epoch`)."""
        self.steps.set_loop_epoch(epoch)

    @property
    def iteration(self) -> int:
        return self.steps.epoch

    @property
    def total_batch_size(self) -> int | None:
        """Samples per step with every group present."""
        size = getattr(self.steps.batch_sampler, "batch_size", None)
        return None if size is None else size * self.steps.groups

    @property
    def total_dataset_length(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, int]:
        """The epoch and the global batches its committed steps consumed (the same on every group)."""
        return self.steps.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [key for key in ("epoch", "global_batches") if key not in state]
        if missing:
            raise ValueError(
                f"A fault-tolerant loader's state needs {missing}; got the keys {sorted(state)} (a state "
                "saved without fault tolerance cannot place a step's batches over replica groups)."
            )
        self.steps.load_state_dict(state)


def quorum_loader(
    data_loader: DataLoader,
    *,
    quorum: Quorum,
    groups: int,
    device: torch.device | None,
    data_seed: int | None,
    refusals: dict[str, bool],
    reading: GroupReading | None = None,
) -> QuorumDataLoader:
    """``data_loader`` as a :class:`QuorumDataLoader`; ``refusals`` maps a setting it cannot honour yet to
    whether it was given; ``reading`` says how an evaluation pass is read (default: never one).

    Raises:
        NotImplementedError: an iterable dataset, ``num_workers > 0`` or a refused setting.
    """
    given = [name for name, on in refusals.items() if on]
    if isinstance(data_loader.dataset, IterableDataset):
        given.append("an IterableDataset (a stream cannot be dealt by global batch index)")
    if data_loader.num_workers > 0:
        given.append(
            f"num_workers={data_loader.num_workers} (workers read batches ahead, before the step's quorum "
            "says which ones this group reads)"
        )
    if given:
        raise NotImplementedError(
            f"Accelerator(fault_tolerance=...) deals each step's batches over the replica groups of that step, "
            f"which does not work with {'; '.join(given)} yet. Use a map-style dataset read in the main "
            "process (num_workers=0) and the default DataLoaderConfiguration."
        )
    batch_sampler = _seeded(data_loader.batch_sampler, data_seed)
    if batch_sampler is None:
        raise NotImplementedError(
            "Accelerator(fault_tolerance=...) needs a DataLoader with automatic batching (a batch_size or a "
            "batch_sampler), to deal whole batches over replica groups; this one has batch_size=None."
        )
    settings = {
        name: getattr(data_loader, name)
        for name in ("collate_fn", "pin_memory", "timeout", "generator", "pin_memory_device")
        if hasattr(data_loader, name)
    }
    steps = StepBatches(batch_sampler, quorum, groups, reading)
    return QuorumDataLoader(data_loader.dataset, batches=steps, device=device, **settings)


def _seeded(batch_sampler: Any, data_seed: int | None) -> Any:
    """The batch sampler with a shuffling ``RandomSampler`` made seedable by a seed every group shares: its
    generator's seed, else ``data_seed``, else :data:`DEFAULT_DATA_SEED`."""
    sampler = getattr(batch_sampler, "sampler", None)
    if not isinstance(sampler, RandomSampler) or isinstance(sampler, SeedableRandomSampler):
        return batch_sampler
    seed = sampler.generator.initial_seed() if sampler.generator is not None else data_seed
    seedable = SeedableRandomSampler(
        sampler.data_source,  # type: ignore[arg-type]
        replacement=sampler.replacement,
        num_samples=sampler._num_samples,
        data_seed=DEFAULT_DATA_SEED if seed is None else seed,
    )
    if type(batch_sampler) is BatchSampler:
        return BatchSampler(seedable, batch_sampler.batch_size, batch_sampler.drop_last)
    raise NotImplementedError(
        f"Accelerator(fault_tolerance=...) found a {type(batch_sampler).__name__} over a RandomSampler: its "
        "order would differ across replica groups. Use a BatchSampler, or a sampler that draws the same order "
        "on every group for a given set_epoch()."
    )
