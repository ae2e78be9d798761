"""What only some backends can do, as small interfaces the facade and the Trainer ask for.

A backend that can do one of these lists the interface among its bases and implements its methods;
:meth:`lockstep.backends.base.Backend.capability` answers ``backend.capability(PipelineSchedule)`` with the
object that does it, or None. A layer (:mod:`lockstep.layers`) may provide one through its step hooks.
Callers ask for the capability, never for the backend (Fabric's ``_BackwardSyncControl`` / ``_Sharded``):

============================  =================================================  ==========================
capability                    what it does                                       provided by (built-ins)
============================  =================================================  ==========================
:class:`JointPreparation`     builds model, optimizer and scheduler as one       DeepSpeed
                              engine that steps itself in ``backward``
:class:`PipelineSchedule`     runs forward and backward of every micro-batch     pipeline
                              through the stages (``accelerator.pipeline_step``)
:class:`ContextParallel`      splits buffers along the sequence and runs         N-D (``cp_size > 1``)
                              attention as ring attention
:class:`ShardedCheckpointIO`  every process writes and reads its own shards of   FSDP, N-D, pipeline,
                              a checkpoint (a collective)                        DeepSpeed
:class:`TrainingStateTransfer`  hands the whole training state of this replica   one process, DDP
                              to a peer and takes one from a peer (live
                              recovery without a checkpoint on disk)
:class:`LiveRecovery`         a replica group that (re)joins a running job       the fault tolerance layer
                              takes the Accelerator's own state (loaders,
                              schedulers, counters) from a live peer too
:class:`StepDataAssignment`   builds the prepared dataloaders itself: each       the fault tolerance layer
                              step's batches dealt over that step's replicas
:class:`GatheredForward`      parameters are sharded over processes and each     FSDP, N-D, pipeline,
                              forward gathers them (generation must then run     DeepSpeed
                              on every process until all have finished)
:class:`ConfiguredOptimizer`  its config may declare the optimizer and           DeepSpeed
                              scheduler: what to give ``prepare`` for them
:class:`GlobalLossTerm`       the model adds a term computed over every rank's   the expert parallelism
                              batch: a loop that multiplies each rank's loss     layer
                              says so, and the term counts once
:class:`SeparateSharding`     a layer shards a submodule with FSDP2 over a mesh  FSDP, N-D, pipeline
                              of its own before the backend shards the model
============================  =================================================  ==========================
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

logger = logging.getLogger("lockstep.backends")
_warned: set[str] = set()

Indexed = Sequence[tuple[int, Any]]
"""``(index, object)`` pairs: the position of a model or optimizer among those prepared, and the object."""


class Capability(ABC):  # noqa: B024 -- a marker base: the capabilities below hold the abstract methods
    """Something only some backends can do; ask ``backend.capability(Kind)``."""


C = TypeVar("C", bound=Capability)
"""A capability type (``backend.capability(kind)`` returns one of these or None)."""


@dataclass
class JointlyPrepared:
    """What a backend that builds model, optimizer and scheduler together (DeepSpeed's engine) made of the
    objects given to one ``prepare`` call: ``(position in the call, prepared object)`` pairs."""

    model: tuple[int, nn.Module]
    optimizer: tuple[int, Any] | None = None
    """The backend's optimizer (the Accelerator wraps it for the user)."""
    scheduler: tuple[int, Any] | None = None
    optimizer_stepped_by_model: bool = False
    """The model steps the optimizer itself (in ``backward``): the user's ``step()`` only notes it."""
    scheduler_stepped_by_model: bool = False
    """The model steps the scheduler itself: the user's ``scheduler.step()`` does nothing."""


class JointPreparation(Capability):
    """The backend builds the model, its optimizer and its scheduler as one engine (DeepSpeed)."""

    @abstractmethod
    def prepare_together(
        self, objects: Sequence[Any], *, accumulation_steps: int, split_batches: bool
    ) -> JointlyPrepared | None:
        """Prepare the model, optimizer and scheduler among the objects of one ``prepare`` call together;
        None when the call holds no model."""

    @abstractmethod
    def stepping_engine(self) -> Any:
        """The engine that steps the optimizer inside ``backward``, or None before one is built."""

    @abstractmethod
    def release(self, model: Any) -> None:
        """Free what the backend holds for a prepared model that ``free_memory`` drops."""


class PipelineSchedule(Capability):
    """The model is cut into stages over processes; a training step runs every micro-batch through them."""

    @abstractmethod
    def pipeline_step(
        self,
        model: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        target: Any,
        loss_fn: Any,
        accumulation_steps: int,
    ) -> torch.Tensor | None:
        """Forward and backward of every micro-batch; the batch's mean loss on the last stage's ranks."""

    @abstractmethod
    def load_whole_model(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        """Load the entries of a whole model's state dict that this rank's stages hold."""

    @abstractmethod
    def causal_lm_loss(self, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        """The next-token loss of a causal language model's outputs (computed on the last stage)."""


class ContextParallel(Capability):
    """Sequences are split over processes and attention runs across them (ring attention)."""

    @abstractmethod
    def context_parallel(
        self,
        buffers: Sequence[torch.Tensor] | None,
        buffer_seq_dims: Sequence[int] | None,
        no_restore_buffers: set[torch.Tensor] | None,
    ) -> contextlib.AbstractContextManager:
        """A block in which ``buffers`` hold this process's part of the sequence."""


class ShardedCheckpointIO(Capability):
    """Every process writes its own part of the model and optimizer state into a checkpoint, and reads it
    back together with the others (both are collectives)."""

    @abstractmethod
    def save_shards(
        self, models: Indexed, optimizers: Indexed, folder: Path, *, frozen_left_out: Collection[int] = ()
    ) -> None:
        """Write this process's shards into ``folder`` (every process together); the models whose index is
        in ``frozen_left_out`` without their frozen parameters (:mod:`lockstep.checkpoint.frozen_base`)."""

    @abstractmethod
    def apply_model_states(self, models: Indexed, optimizers: Indexed, loaded: Any) -> None:
        """Restore what needs every process together, from what ``read_model_states`` returned."""


class TrainingStateTransfer(Capability):
    """The whole training state of this replica, in memory: what a replica that rejoins a running job
    takes from a live peer instead of from a checkpoint on disk."""

    @abstractmethod
    def training_state(self, models: Sequence[nn.Module], optimizers: Sequence[Any]) -> dict[str, Any]:
        """This replica's model and optimizer state as CPU tensors and plain values (picklable)."""

    @abstractmethod
    def load_training_state(
        self, models: Sequence[nn.Module], optimizers: Sequence[Any], state: dict[str, Any]
    ) -> None:
        """Make this replica's models and optimizers hold ``state`` (from :meth:`training_state` of a peer)."""


class LiveRecovery(Capability):
    """Replica groups that come and go while the others train: one that (re)joins heals from a live peer.

    The backend moves the models and optimizers itself; the Accelerator shares the rest of the training
    state here (prepared loaders' positions, schedulers, registered objects, counters), and calls
    :meth:`join` once a ``prepare`` call has built a trainable replica, before any batch is read, so that a
    group that heals reads its first batch where its peers stand.
    """

    progress_key: ClassVar[str]
    """The entry of a checkpoint's counters that holds :meth:`saved_progress` (the backend names it)."""

    @abstractmethod
    def share_training_state(
        self,
        key: str,
        state_dict: Callable[[], Any],
        load_state_dict: Callable[[Any], None],
        *,
        at_step_end: bool = False,
    ) -> None:
        """Send ``state_dict()`` to a healing peer and load a peer's with ``load_state_dict``.

        Args:
            key: a name unique among the shared states (the same on every group).
            state_dict: the state now (picklable with ``weights_only``: tensors and plain values).
            load_state_dict: makes this group hold a peer's ``state_dict()``.
            at_step_end: send the state as it was when the last step ended, not as it is when the peer asks
                (a loader has read the next batch by then; a scheduler has not stepped at the step's end).
        """

    @abstractmethod
    def join(self) -> None:
        """Join the job's next step now (healing from a live peer when this group is behind); once per step."""

    @abstractmethod
    def saved_progress(self) -> dict[str, int]:
        """What a checkpoint holds besides the Accelerator's state (the committed step count), so that a
        restart of every group continues where the save was taken."""

    @abstractmethod
    def load_saved_progress(self, progress: dict[str, int]) -> None:
        """Continue from a checkpoint's :meth:`saved_progress`."""


def no_context_parallel() -> contextlib.AbstractContextManager:
    """The block of ``maybe_context_parallel`` without context parallelism: it runs unchanged (the buffers
    stay whole), with a warning once per process, as in Accelerate."""
    if "maybe_context_parallel" not in _warned:
        _warned.add("maybe_context_parallel")
        logger.warning(
            "maybe_context_parallel() has no effect: context parallelism is not enabled, so the buffers are "
            "not split along the sequence. Pass Accelerator(parallelism_config=ParallelismConfig(cp_size=N)) "
            "to split them over N processes."
        )
    return contextlib.nullcontext()


NO_PIPELINE = (
    "accelerator.pipeline_step() runs a pipeline-parallel model, and this Accelerator has no pipeline: "
    "pass Accelerator(parallelism_config=ParallelismConfig(pp_size=...)), or train this model with "
    "loss = loss_fn(model(inputs), labels); accelerator.backward(loss)."
)
"""The error of ``pipeline_step`` on a backend without a :class:`PipelineSchedule`."""


class StepDataAssignment(Capability):
    """The backend deals each step's batches over the replicas taking part in that step, instead of a fixed
    share of every epoch per process (replicas that come and go: fault tolerance)."""

    @abstractmethod
    def prepare_data_loader(self, data_loader: Any, *, device: torch.device | None, config: Any) -> Any:
        """The prepared loader for the user's ``data_loader`` (batches moved to ``device`` unless None), under
        the Accelerator's ``DataLoaderConfiguration`` ``config``."""


class GatheredForward(Capability):
    """Parameters are sharded over processes and each forward gathers them from every process (FSDP2's
    ``fully_shard``, ZeRO-3): a process cannot run a forward alone."""

    @abstractmethod
    def gathers_in_forward(self, model: nn.Module) -> bool:
        """Whether a forward of ``model`` gathers parameters from every process (then every process must keep
        generating until all have finished: ``synced_gpus``)."""

    @abstractmethod
    def root_parameters_gathered(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """A block in which the parameters sharded with ``model``'s root are whole: code that calls submodules
        directly (``generate`` calls the encoder) bypasses the root's forward, which would gather them."""


class ConfiguredOptimizer(Capability):
    """The backend's own config may declare the optimizer and the scheduler (DeepSpeed's ``optimizer`` and
    ``scheduler`` entries); the backend builds them at ``prepare`` from placeholders."""

    @abstractmethod
    def optimizer_and_scheduler(
        self,
        model: nn.Module,
        *,
        learning_rate: float,
        weight_decay: float,
        warmup_steps: int,
        max_steps: int,
        build_optimizer: Callable[[], Any],
        build_scheduler: Callable[[Any], Any],
    ) -> tuple[Any, Any]:
        """What to give ``prepare`` for ``model``: the config's optimizer and scheduler as placeholders (their
        ``"auto"`` values filled from the arguments), or the caller's own (``build_optimizer()``, and
        ``build_scheduler(optimizer)`` on the optimizer given or on the one the config declares)."""


class GlobalLossTerm(Capability):
    """The model adds to each rank's loss a term computed over every rank's batch, the same on each (expert
    parallelism's global router loss).

    A training loop that multiplies each rank's loss by a factor before its backward (a loss summed over the
    job: the Trainer's ``num_items_in_batch`` with ``average_tokens_across_devices``) runs the forward inside
    :meth:`loss_multiplied_by`, so that the term counts once.
    """

    @abstractmethod
    def loss_multiplied_by(self, factor: float) -> contextlib.AbstractContextManager[None]:
        """The forwards inside return a loss that the loop multiplies by ``factor`` before its backward."""


class SeparateSharding(Capability):
    """The backend shards models with FSDP2 (``fully_shard``), and a layer may shard a submodule over a mesh of
    its own first, in its ``preparing_model`` (expert parallelism: the experts over the ranks that hold the same
    experts, not over every data-parallel rank). The backend's own sharding of the model then leaves that
    submodule's parameters to it (``fully_shard`` skips a submodule that is sharded already)."""

    @abstractmethod
    def shard_apart(
        self, module: nn.Module, mesh: Any, *, replaced: Mapping[str, nn.Parameter] | None = None
    ) -> None:
        """``fully_shard`` ``module`` over ``mesh`` (a 1-D ``DeviceMesh``) with the backend's settings (precision
        policy, offload, resharding after forward).

        Args:
            module: a submodule of a model about to be prepared.
            mesh: the ranks to shard it over.
            replaced: parameters that an optimizer built before ``prepare`` may hold, by the name (in
                ``module``) of the parameter that replaced them before sharding: ``prepare`` re-binds such an
                optimizer to the sharded parameters.
        """
