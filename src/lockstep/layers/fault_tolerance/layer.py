"""Replica groups that average gradients through torchft's per-step quorum: a layer of step hooks.

Each replica group is an ordinary lockstep job of one or more processes, trained inside by the backend the
settings choose (one process, DDP or FSDP2); this layer, one of the Accelerator's step hooks
(:mod:`lockstep.step_hooks`), adds the step's quorum, the average across groups and the heal, and never wraps
the backend. Per optimizer step:

1. the step's quorum is asked of the lighthouse and waited for (``Manager.start_quorum`` with
   ``use_async_quorum=False``): when the ``prepare`` call that holds the optimizer returns (the first step),
   then at the step's first batch read from a prepared loader, its first training forward or its first
   backward, whichever comes first. A group that is behind (one that was
   relaunched, or joins late) heals there, from a live peer, before it reads a batch or runs a forward:
   torchft sends it the peer's models, optimizer and step count, and the Accelerator's loader positions,
   schedulers, registered objects and counters (:mod:`lockstep.accelerator.live_state`), so every group in
   the quorum computes a real gradient on the same weights and no group's batch is replaced by zeros;
2. ``optimizer.step()`` all-reduces the gradients over the groups in the quorum, after the backend
   averaged them inside the group (one flat buffer per dtype, summed, divided by the participants; rank
   ``r`` of each group with rank ``r`` of the others, on its own shard under FSDP2), then asks every
   process of every group whether the step commits
   (``Manager.should_commit``): the optimizer steps only when it does, so all live groups apply the same
   averaged gradient or none do.

Prepared loaders deal each step's global batches over that step's participants (over every process of
each), and consume them only when the step commits (:mod:`lockstep.layers.fault_tolerance.data`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any, final

import torch
from torch import nn

from lockstep.backends.base import Backend
from lockstep.backends.capabilities import LiveRecovery, StepDataAssignment
from lockstep.errors import ReplicaQuorumError
from lockstep.layers.fault_tolerance.config import FaultToleranceConfig
from lockstep.layers.fault_tolerance.data import GroupReading, StepBatches, quorum_loader
from lockstep.layers.fault_tolerance.job_start import JobStart
from lockstep.layers.fault_tolerance.launch import PIP_LINE
from lockstep.layers.fault_tolerance.manager import shut_down, start_manager
from lockstep.layers.fault_tolerance.optimizer import average_gradients, trained_parameters
from lockstep.state import PartialState
from lockstep.step_hooks import StepHook

logger = logging.getLogger("lockstep.layers")
PEER_KEY = "lockstep_peer"
"""The shared state that names the group a healing group received the others from."""


@final
class FaultTolerance(LiveRecovery, StepDataAssignment, StepHook):
    """A replica per group; gradients averaged across the live groups of each step (torchft).

    Its step-hook moments: a prepared model and optimizer are sent to healing peers (and a training forward
    joins the step's quorum), ``backward`` joins it too, clipping averages the step's gradients over the
    quorum first, and the commit answer averages them (unless clipping did) and asks every group whether
    the step is applied. It deals each step's batches to prepared loaders (:class:`StepDataAssignment`) and
    heals a group from a live peer (:class:`LiveRecovery`).

    Args:
        state: the process state (the processes of this replica group).
        config: which group this is and which lighthouse keeps the quorum.
        backend: the backend that trains the replica inside the group (one process, DDP or FSDP2).
    """

    def __init__(self, state: PartialState, *, config: FaultToleranceConfig, backend: Backend) -> None:
        self.state = state
        self.backend = backend
        self.config = config
        self.manager, store = start_manager(config, config.lighthouse_address(), state)
        self._finalizer = weakref.finalize(self, shut_down, self.manager, store)
        self._job_start: JobStart | None = JobStart(
            group=config.replica_group,
            groups=config.num_replica_groups,
            address=config.lighthouse_address(),
            timeout=config.timeout,
            process=state.process_index,
            processes=state.num_processes,
        )
        self._quorum_started = False
        self._averaged = False
        self._models = 0
        self._trained: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._optimizer: torch.optim.Optimizer | None = None
        self._step_end: dict[str, Callable[[], Any]] = {}
        self._loaders: list[StepBatches] = []
        self._at_step_end: dict[str, Any] = {}
        self.last_heal: dict[str, Any] | None = None
        """The last heal: the peer's ``replica_group``, ``pid`` and ``step`` (the step this group joined at)."""
        self.manager.register_state_dict_fn(PEER_KEY, self._note_heal, self._identity)

    def close(self) -> None:
        """Leave the quorum, stop torchft's servers and drop its process group (also done when the layer is
        collected, or at exit)."""
        self._finalizer()

    # -- data (StepDataAssignment) ------------------------------------------------------------------
    @property
    def _processes(self) -> int:
        return self.state.num_processes

    def prepare_data_loader(self, data_loader: Any, *, device: torch.device | None, config: Any) -> Any:
        """A loader that reads, at each step, this process's global batch among the step's participants
        (:mod:`lockstep.layers.fault_tolerance.data`)."""
        refusals = {
            "DataLoaderConfiguration(split_batches=True)": config.split_batches,
            "DataLoaderConfiguration(dispatch_batches=True)": bool(config.dispatch_batches),
            "DataLoaderConfiguration(use_stateful_dataloader=True)": config.use_stateful_dataloader,
        }
        loader = quorum_loader(
            data_loader,
            quorum=self._readers,
            groups=self.config.num_replica_groups * self._processes,
            device=device,
            data_seed=config.data_seed,
            refusals=refusals,
            reading=GroupReading(
                evaluating=self._evaluating,
                process=self.state.process_index,
                processes=self._processes,
                even_batches=config.even_batches,
            ),
        )
        self._loaders.append(loader.steps)
        return loader

    def _evaluating(self) -> bool:
        """Every prepared model is in eval mode (and there is one): a loader read now is an evaluation pass.
        A model counts as in eval mode when its wrapper or the module inside is (``unwrap_model(m).eval()``
        leaves a DDP wrapper's flag as it was)."""
        models = list(self._trained)
        return bool(models) and not any(m.training and self.backend.unwrap_model(m).training for m in models)

    def _readers(self) -> tuple[int, int]:
        """Join this step's quorum; the processes that read a batch this step (every process of each
        participating group) and this process's place among them."""
        participants, rank = self._quorum()
        return participants * self._processes, rank * self._processes + self.state.process_index

    def _quorum(self) -> tuple[int, int]:
        """Join this step's quorum; the participants and this group's rank among them."""
        self._start_quorum()
        rank = self.manager.participating_rank()
        if rank is None:
            raise ReplicaQuorumError(
                f"Replica group {self.config.replica_group} is not among the participants of torchft's quorum "
                f"at step {self.manager.current_step()}, so it has no share of the step's batches."
            )
        return self.manager.num_participants(), rank

    # -- models and optimizers (the backend's, then shared with healing peers) ---------------------
    def prepared_model(self, model: object) -> None:
        # A healing process receives the replica from the same rank of a live peer group; under FSDP2 that is
        # its own shard (DTensors, which torchft's transport carries as they are).
        assert isinstance(model, nn.Module)
        self.manager.register_state_dict_fn(f"model_{self._models}", model.load_state_dict, model.state_dict)
        self._models += 1
        self._trained.add(model)
        model.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled():
            self._start_quorum()

    def prepared_optimizer(self, optimizer: object) -> None:
        if self._optimizer is not None:
            raise ValueError(
                "Accelerator(fault_tolerance=...) steps one optimizer per replica group so far (each step is "
                "one quorum and one commit); a second one was prepared. Put all parameters in one optimizer."
            )
        assert isinstance(optimizer, torch.optim.Optimizer)
        self.manager.register_state_dict_fn("optimizer", optimizer.load_state_dict, optimizer.state_dict)
        self._optimizer = optimizer

    # -- the step ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def around_backward(self) -> Iterator[None]:
        if any(loader.evaluation_pass for loader in self._loaders):
            raise RuntimeError(
                "accelerator.backward() ran while a prepared loader was read as an evaluation pass: every "
                "prepared model was in eval mode when its iteration began, so each replica group reads the "
                "whole set and no step of it may be trained. Call model.train() before iterating a "
                "training loader."
            )
        self._start_quorum()
        yield

    @property
    def participants(self) -> int:
        """Replica groups in the current step's quorum."""
        return self.manager.num_participants()

    @property
    def committed_steps(self) -> int:
        """Steps this group has committed (torchft's step count, which a healed group takes from its peer)."""
        return self.manager.current_step()

    # -- healing (LiveRecovery) ------------------------------------------------------------------
    progress_key = "fault_tolerance"
    """Where a checkpoint's counters hold torchft's committed steps (:meth:`saved_progress`)."""

    def share_training_state(
        self,
        key: str,
        state_dict: Callable[[], Any],
        load_state_dict: Callable[[Any], None],
        *,
        at_step_end: bool = False,
    ) -> None:
        if at_step_end:
            self._step_end[key] = state_dict
            self.manager.register_state_dict_fn(key, load_state_dict, lambda: self._state_at_step_end(key))
        else:
            self.manager.register_state_dict_fn(key, load_state_dict, state_dict)

    def _state_at_step_end(self, key: str) -> Any:
        # Before the first commit nothing was read yet: the state now is the state at the start.
        return self._at_step_end[key] if key in self._at_step_end else self._step_end[key]()

    def join(self) -> None:
        self._start_quorum(training=False)

    def saved_progress(self) -> dict[str, int]:
        return {key: int(value) for key, value in self.manager.state_dict().items()}

    def load_saved_progress(self, progress: dict[str, int]) -> None:
        # torchft's step and batches committed: the next quorum tells the lighthouse where this group is.
        self.manager.load_state_dict(progress)

    def _identity(self) -> dict[str, int]:
        return {
            "replica_group": self.config.replica_group,
            "pid": os.getpid(),
            "step": self.manager.current_step(),
        }

    def _note_heal(self, peer: dict[str, int]) -> None:
        self.last_heal = dict(peer)
        log = logger.warning if peer["step"] > 0 else logger.info
        log(
            "replica group %d healed from replica group %d (pid %d) at step %d: weights, optimizer, loader "
            "positions and schedulers taken from the live peer, no checkpoint read",
            self.config.replica_group,
            peer["replica_group"],
            peer["pid"],
            peer["step"],
        )

    def _start_quorum(self, *, training: bool = True) -> None:
        """Join this step's quorum (healing first when behind); a group that starts at step 0 follows the
        job's start rules (:mod:`lockstep.layers.fault_tolerance.job_start`), so that the job keeps one
        history. ``training=False``: the quorum ``prepare`` joins (see :meth:`JobStart.may_train`)."""
        if self._quorum_started:
            return
        start = self._job_start
        if start is not None and self.manager.current_step() == 0:
            if start.history_step is None:
                start.wait_for_groups()
            if not start.may_ask(training=training):  # prepare's quorum, with nothing to heal from yet
                return
        if not self._request_quorum(start, training):
            return
        while start is not None and not (verdict := start.may_train(self.manager, training=training)):
            if verdict is None or not self._request_quorum(start, training):
                return  # prepare's quorum: only groups at step 0 (or none) while the job has a history
        if self.manager.current_step() > 0:  # it stands in the job's history: the start rules are done
            self._job_start = None
        self._quorum_started = True

    def _request_quorum(self, start: JobStart | None = None, training: bool = True) -> bool:
        """Ask for this step's quorum; False when a group at step 0 got none because the job's history has no
        live group left, in ``prepare`` (a training step ends the process then: :meth:`JobStart.no_quorum`)."""
        try:
            with contextlib.ExitStack() as receiving:  # a heal here loads the loaders' positions from a peer
                for loader in self._loaders:
                    receiving.enter_context(loader.receiving_from_peer())
                self.manager.start_quorum()
        except Exception as error:  # torchft raises its RPC's TimeoutError or RuntimeError
            if start is not None and self.manager.current_step() == 0 and start.no_quorum(training=training):
                return False
            config = self.config
            raise ReplicaQuorumError(
                f"Replica group {config.replica_group} got no quorum from the torchft lighthouse at "
                f"{config.lighthouse_address()} within {config.timeout:g} s ({type(error).__name__}: {error}): "
                f"the lighthouse is down or unreachable, or fewer than min_replicas={config.min_replicas} "
                "groups are alive. Restart the lighthouse, then the groups (each resumes with "
                "accelerator.resume_from_latest_checkpoint()); or raise FaultToleranceConfig(timeout=...)."
            ) from error
        return True

    def before_clip(self) -> None:
        """Average the step's gradients over the quorum before they are clipped (as DDP does), instead of in
        the commit."""
        if self._optimizer is not None:
            self._average(trained_parameters(self._optimizer))

    def commit(self, optimizer: object) -> bool:
        """Average the step's gradients over the quorum (unless clipping did) and whether every group commits
        the step (one optimizer per group: the answer for it); one that does not commit leaves the weights,
        the optimizer's state and the prepared schedulers as they were."""
        if self._optimizer is None:
            return True
        return self._synchronize(trained_parameters(self._optimizer))

    def _average(self, parameters: list[torch.Tensor]) -> None:
        if self._averaged:
            return
        self._start_quorum()
        for dtype in dict.fromkeys(p.dtype for p in parameters):
            average_gradients(self.manager, [p for p in parameters if p.dtype == dtype])
        self._averaged = True

    def _synchronize(self, parameters: list[torch.Tensor]) -> bool:
        """Average the gradients over this step's quorum (unless clipping did); whether every group commits
        the step."""
        self._average(parameters)
        self._quorum_started = self._averaged = False
        committed = self.manager.should_commit()
        for loader in self._loaders:  # a step that did not commit leaves its samples to be read again
            loader.step_ended(committed)
        # Where a group that heals before the next step starts (also after a discarded step).
        self._at_step_end = {key: state_dict() for key, state_dict in self._step_end.items()}
        return committed


def fault_tolerance_hooks(config: FaultToleranceConfig, accelerator: Any) -> list[StepHook]:
    """The layer for ``accelerator`` (its spec's hook builder: :mod:`lockstep.layers.fault_tolerance.spec`).

    Raises:
        ValueError: a layout it does not support yet (DeepSpeed, a ParallelismConfig), by name.
    """
    unsupported = {
        "DeepSpeed (deepspeed_plugin)": bool(accelerator.state.deepspeed_plugins),
        "a ParallelismConfig (pipeline, tensor, context or sharded layouts)": (
            accelerator.parallelism_config is not None
        ),
    }
    for name, given in unsupported.items():
        if given:
            raise ValueError(
                f"Accelerator(fault_tolerance=...) with {name} is not supported yet: each replica group trains "
                "its replica on one process, or on several with DDP or FSDP. Drop one of the two settings."
            )
    try:
        import torchft  # noqa: F401
    except ImportError as error:
        raise ImportError(
            f"Accelerator(fault_tolerance=...) trains on torchft, which is not installed: {PIP_LINE}."
        ) from error
    return [FaultTolerance(accelerator.state, config=config, backend=accelerator.backend)]
