"""Replica groups that average gradients through torchft's per-step quorum.

Each replica group is one lockstep process holding a whole replica. Per optimizer step:

1. the step's quorum is asked of the lighthouse and waited for (``Manager.start_quorum`` with
   ``use_async_quorum=False``): when the ``prepare`` call that holds the optimizer returns (the first step),
   then at the step's first batch read from a prepared loader, its first training forward or its first
   backward, whichever comes first. A group that is behind (one that was
   relaunched, or joins late) heals there, from a live peer, before it reads a batch or runs a forward:
   torchft sends it the peer's models, optimizer and step count, and the Accelerator's loader positions,
   schedulers, registered objects and counters (:mod:`lockstep.accelerator.live_state`), so every group in
   the quorum computes a real gradient on the same weights and no group's batch is replaced by zeros;
2. ``optimizer.step()`` all-reduces the gradients over the groups in the quorum (one flat buffer per dtype,
   summed, divided by the participants), then asks every group whether the step commits
   (``Manager.should_commit``): the optimizer steps only when it does, so all live groups apply the same
   averaged gradient or none do.

Prepared loaders deal each step's global batches over that step's participants, and consume them only when
the step commits (:mod:`lockstep.backends.ft.data`).
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
import weakref
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, final

import torch
from torch import nn

from lockstep.backends.base import Backend, DataShard
from lockstep.backends.capabilities import LiveRecovery, StepDataAssignment
from lockstep.backends.ft.config import FaultToleranceConfig
from lockstep.backends.ft.data import StepBatches, quorum_loader
from lockstep.config.plugins import TorchDynamoPlugin
from lockstep.precision import Precision
from lockstep.state import PartialState

logger = logging.getLogger("lockstep.backends")
PEER_KEY = "lockstep_peer"
"""The shared state that names the group a healing group received the others from."""


def _manager(config: FaultToleranceConfig, address: str) -> Any:
    """torchft's Manager for this group of one process, on a store of its own."""
    # torchft 0.2.0's _ManagerLogger.warn calls the deprecated Logger.warn (torchft/manager.py) on every
    # CPU quorum; under -W error that DeprecationWarning is raised inside the quorum, which torchft records
    # as an error, and no step would ever commit. Scoped to that module and message.
    warnings.filterwarnings(
        "ignore", message="The 'warn' method is deprecated", category=DeprecationWarning, module="torchft"
    )
    from torch.distributed import TCPStore
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    timeout = timedelta(seconds=config.timeout)
    hostname = config.hostname or socket.gethostname()
    store = TCPStore(hostname, 0, is_master=True, wait_for_workers=False, timeout=timeout)
    try:
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=config.min_replicas,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=0,
            world_size=1,
            store_addr=hostname,
            store_port=store.port,
            lighthouse_addr=address,
            use_async_quorum=False,
            replica_id=config.replica_id,
            hostname=hostname,
        )
    except RuntimeError as error:
        raise RuntimeError(
            f"Replica group {config.replica_group} could not join the torchft lighthouse at {address} within "
            f"{config.timeout:g} s: {error}. Check that the lighthouse runs and that this machine reaches it, "
            "or raise FaultToleranceConfig(timeout=...)."
        ) from error
    manager._lockstep_store = store  # the store must outlive the manager, which connects to it by address
    return manager


@final
class FaultTolerantBackend(Backend, LiveRecovery, StepDataAssignment):
    """One replica per group; gradients averaged across the live groups of each step (torchft).

    Args:
        state: the process state (one process per replica group).
        precision: the mixed-precision setting.
        config: which group this is and which lighthouse keeps the quorum.
        dynamo_plugin: ``torch.compile`` settings.
    """

    def __init__(
        self,
        state: PartialState,
        *,
        precision: Precision,
        config: FaultToleranceConfig,
        dynamo_plugin: TorchDynamoPlugin | None = None,
    ) -> None:
        super().__init__(state, precision=precision, dynamo_plugin=dynamo_plugin)
        self.distributed_type = state.distributed_type
        self.config = config
        self.manager = _manager(config, config.lighthouse_address())
        self._finalizer = weakref.finalize(self, self.manager.shutdown, wait=False)
        self._quorum_started = False
        self._averaged = False
        self._models = 0
        self._optimizer: _QuorumOptimizer | None = None
        self._step_end: dict[str, Callable[[], Any]] = {}
        self._loaders: list[StepBatches] = []
        self._at_step_end: dict[str, Any] = {}
        self.last_heal: dict[str, Any] | None = None
        """The last heal: the peer's ``replica_group``, ``pid`` and ``step`` (the step this group joined at)."""
        self.manager.register_state_dict_fn(PEER_KEY, self._note_heal, self._identity)

    def close(self) -> None:
        """Leave the quorum and stop torchft's servers (also done when the backend is collected)."""
        self._finalizer()

    def data_shard(self) -> DataShard:
        """The replica group among the groups the job starts with (prepared loaders deal each step's batches
        over that step's participants instead: :meth:`prepare_data_loader`)."""
        return DataShard(index=self.config.replica_group, count=self.config.num_replica_groups)

    def prepare_data_loader(self, data_loader: Any, *, device: torch.device | None, config: Any) -> Any:
        """A loader that reads, at each step, this group's global batch among the step's participants
        (:mod:`lockstep.backends.ft.data`)."""
        refusals = {
            "DataLoaderConfiguration(split_batches=True)": config.split_batches,
            "DataLoaderConfiguration(dispatch_batches=True)": bool(config.dispatch_batches),
            "DataLoaderConfiguration(use_stateful_dataloader=True)": config.use_stateful_dataloader,
        }
        loader = quorum_loader(
            data_loader,
            quorum=self._quorum,
            groups=self.config.num_replica_groups,
            device=device,
            data_seed=config.data_seed,
            refusals=refusals,
        )
        self._loaders.append(loader.steps)
        return loader

    def _quorum(self) -> tuple[int, int]:
        """Join this step's quorum; the participants and this group's rank among them."""
        self._start_quorum()
        rank = self.manager.participating_rank()
        if rank is None:
            raise RuntimeError(
                f"Replica group {self.config.replica_group} is not among the participants of torchft's quorum "
                f"at step {self.manager.current_step()}, so it has no share of the step's batches."
            )
        return self.manager.num_participants(), rank

    def wrap_model(self, model: nn.Module) -> nn.Module:
        # The whole replica lives in this process; a healing group receives it from a live peer.
        self.manager.register_state_dict_fn(f"model_{self._models}", model.load_state_dict, model.state_dict)
        self._models += 1
        model.register_forward_pre_hook(self._before_forward)
        return model

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled():
            self._start_quorum()

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if self._optimizer is not None:
            raise ValueError(
                "Accelerator(fault_tolerance=...) steps one optimizer per replica group so far (each step is "
                "one quorum and one commit); a second one was prepared. Put all parameters in one optimizer."
            )
        self.manager.register_state_dict_fn("optimizer", optimizer.load_state_dict, optimizer.state_dict)
        self._optimizer = _QuorumOptimizer(optimizer, self._synchronize)
        return self._optimizer

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self._start_quorum()
        super().backward(loss, **kwargs)

    @property
    def participants(self) -> int:
        """Replica groups in the current step's quorum."""
        return self.manager.num_participants()

    @property
    def committed_steps(self) -> int:
        """Steps this group has committed (torchft's step count, which a healed group takes from its peer)."""
        return self.manager.current_step()

    # -- healing (LiveRecovery) ------------------------------------------------------------------
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
        self._start_quorum()

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

    def _start_quorum(self) -> None:
        if self._quorum_started:
            return
        try:
            self.manager.start_quorum()
        except Exception as error:  # torchft raises its RPC's TimeoutError or RuntimeError
            config = self.config
            raise RuntimeError(
                f"Replica group {config.replica_group} got no quorum from the torchft lighthouse at "
                f"{config.lighthouse_address()} within {config.timeout:g} s ({type(error).__name__}: {error}): "
                f"the lighthouse is down or unreachable, or fewer than min_replicas={config.min_replicas} "
                "groups are alive. Restart the lighthouse, then the groups (each resumes with "
                "accelerator.resume_from_latest_checkpoint()); or raise FaultToleranceConfig(timeout=...)."
            ) from error
        self._quorum_started = True

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip the averaged gradients (as DDP does): the step's gradients are averaged across the groups
        here, before the norm, instead of in ``optimizer.step()``."""
        if self._optimizer is not None:
            self._average(self._optimizer.trained_parameters())
        return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def _average(self, parameters: list[torch.Tensor]) -> None:
        if self._averaged:
            return
        self._start_quorum()
        for dtype in dict.fromkeys(p.dtype for p in parameters):
            _average(self.manager, [p for p in parameters if p.dtype == dtype])
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


def _average(manager: Any, parameters: list[torch.Tensor]) -> None:
    """All-reduce one flat buffer of gradients (a missing gradient counts as zeros) and copy it back."""
    for parameter in parameters:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
    flat = torch.cat([p.grad.detach().reshape(-1) for p in parameters])
    manager.allreduce(flat).wait()
    offset = 0
    for parameter in parameters:
        size = parameter.numel()
        parameter.grad.copy_(flat[offset : offset + size].view_as(parameter.grad))
        offset += size


class _QuorumOptimizer(torch.optim.Optimizer):
    """The user's optimizer, stepped only when the step's quorum commits (its state is the user's)."""

    def __init__(self, optimizer: torch.optim.Optimizer, synchronize: Callable[[list[torch.Tensor]], bool]):
        # No Optimizer.__init__: state and param_groups stay the wrapped optimizer's own objects.
        self.optimizer = optimizer
        self._synchronize = synchronize
        self.committed: bool | None = None
        """Whether the last step committed (None before the first)."""

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        if closure is not None:
            raise ValueError(
                "Accelerator(fault_tolerance=...) cannot step with a closure (one quorum per step)."
            )
        self.committed = self._synchronize(self.trained_parameters())
        return self.optimizer.step() if self.committed else None

    @property
    def step_was_skipped(self) -> bool:
        """The last step did not commit (the prepared optimizer and its schedulers read this)."""
        return self.committed is False

    def trained_parameters(self) -> list[torch.Tensor]:
        """The parameters this optimizer updates, in its (every group's identical) order."""
        return [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]

    def __repr__(self) -> str:
        return f"FaultTolerant({self.optimizer!r})"
