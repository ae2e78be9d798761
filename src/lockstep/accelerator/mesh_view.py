"""The Accelerator's members for the N-D layout: ``parallelism_config``, ``torch_device_mesh``, the ranks and
``maybe_context_parallel``.

:func:`build_layout` checks a ``ParallelismConfig`` against the run and builds its device mesh, once per
Accelerator, before the backend is chosen. :class:`MeshView` answers Accelerate's members from the
process state: None and raising ranks without a ``ParallelismConfig`` (as Accelerate), the mesh and each
dimension's local rank (0 for a dimension of size 1) with one. ``maybe_context_parallel`` is the backend's
(:meth:`lockstep.backends.base.Backend.context_parallel`).

Example:
    >>> from lockstep.state import AcceleratorState
    >>> view = MeshView(AcceleratorState(cpu=True), backend=None)
    >>> view.parallelism_config is None, view.torch_device_mesh is None
    (True, True)
    >>> view.tensor_parallel_rank
    Traceback (most recent call last):
    RuntimeError: Accelerator.tensor_parallel_rank: tensor parallelism is not configured. Pass Accelerator(parallelism_config=ParallelismConfig(tp_size=...)).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from lockstep import _env
from lockstep.backends.capabilities import ContextParallel, no_context_parallel
from lockstep.config.parallelism import ParallelismConfig
from lockstep.state import AcceleratorState

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from lockstep.backends.base import Backend

logger = logging.getLogger(__name__)


def build_layout(config: ParallelismConfig, state: AcceleratorState) -> None:
    """Check ``config`` against the run's processes and build its device mesh (a collective). In an elastic
    job that came back on another number of processes, the data-parallel sizes follow it (logged once)."""
    if _env.launch_settings().get("elastic") and config.total_size not in (1, state.num_processes):
        change = config.fit_data_parallel(state.num_processes)
        if change and state.is_main_process:
            logger.warning("elastic job on %d processes: ParallelismConfig %s", state.num_processes, change)
    config.validate_world_size(state.num_processes)
    config.get_device_mesh(state.device.type)


def _not_configured(member: str, what: str, size: str) -> NoReturn:
    raise RuntimeError(
        f"Accelerator.{member}: {what} is not configured. Pass "
        f"Accelerator(parallelism_config=ParallelismConfig({size}=...))."
    )


class MeshView:
    """Accelerate's members for the device mesh of a ``ParallelismConfig``.

    Args:
        state: the process state (its ``parallelism_config`` and mesh).
        backend: the backend, asked for context parallelism.
    """

    def __init__(self, state: AcceleratorState, backend: Backend | None) -> None:
        self.state = state
        self.backend = backend

    @property
    def parallelism_config(self) -> ParallelismConfig | None:
        """The ``ParallelismConfig`` the Accelerator was given (or the launcher set), else None."""
        return self.state.parallelism_config

    @property
    def torch_device_mesh(self) -> DeviceMesh | None:
        """The N-D device mesh (dimensions in Accelerate's order, only those of size > 1), else None."""
        return self.state.device_mesh

    def _local_rank(self, dimension: str) -> int:
        config = self.state.parallelism_config
        assert config is not None
        if getattr(config, f"{dimension}_size") == 1:
            return 0
        return config.device_mesh.get_local_rank(dimension)  # type: ignore[union-attr]

    @property
    def tensor_parallel_rank(self) -> int:
        """This process's index in its ``tp`` group (0 when ``tp_size`` is 1)."""
        if self.state.parallelism_config is None:
            _not_configured("tensor_parallel_rank", "tensor parallelism", "tp_size")
        return self._local_rank("tp")

    @property
    def data_parallel_rank(self) -> int:
        """This process's index along ``dp_replicate`` (0 when ``dp_replicate_size`` is 1)."""
        if self.state.parallelism_config is None:
            _not_configured("data_parallel_rank", "replicated data parallelism", "dp_replicate_size")
        return self._local_rank("dp_replicate")

    @property
    def data_parallel_shard_rank(self) -> int:
        """This process's index along ``dp_shard`` (0 when ``dp_shard_size`` is 1)."""
        if self.state.parallelism_config is None:
            _not_configured("data_parallel_shard_rank", "sharded data parallelism", "dp_shard_size")
        return self._local_rank("dp_shard")

    @property
    def pipeline_parallel_rank(self) -> int:
        """This process's index along ``pp`` (0 when ``pp_size`` is 1): which pipeline stages it holds."""
        if self.state.parallelism_config is None:
            _not_configured("pipeline_parallel_rank", "pipeline parallelism", "pp_size")
        return self._local_rank("pp")

    @property
    def context_parallel_rank(self) -> int:
        """This process's index along ``cp`` (0 when ``cp_size`` is 1)."""
        if self.state.parallelism_config is None:
            _not_configured("context_parallel_rank", "context parallelism", "cp_size")
        return self._local_rank("cp")

    def maybe_context_parallel(
        self,
        buffers: Sequence[torch.Tensor] | None = None,
        buffer_seq_dims: Sequence[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ) -> contextlib.AbstractContextManager:
        """``Accelerator.maybe_context_parallel``: the batch split along the sequence (see there)."""
        splitter = self.backend.capability(ContextParallel) if self.backend is not None else None
        if splitter is None:
            return no_context_parallel()
        return splitter.context_parallel(buffers, buffer_seq_dims, no_restore_buffers)
