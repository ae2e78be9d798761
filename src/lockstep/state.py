"""Who am I: rank, world size, device and backend, read from the environment once.

:class:`PartialState` works without an :class:`~lockstep.Accelerator`; every instance of it in a
process shares one underlying :class:`_ProcessContext`, created by the first one. On a CPU-only machine
two processes started by torchrun form one gloo group of world size 2 with no extra flag.

Example:
    >>> state = PartialState()
    >>> state.num_processes, state.process_index
    (1, 0)
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist

from lockstep import _env, _process_group
from lockstep.config.enums import DistributedType
from lockstep.config.kwargs import validate_backend_name
from lockstep.integrations import ray_train

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class _ProcessContext:
    """The facts about this process that never change during a run."""

    cluster: _env.ClusterEnvironment
    device: torch.device
    backend: str | None
    distributed_type: DistributedType
    debug: bool
    accelerator_settings: dict[str, Any] = field(default_factory=dict)
    """Settings recorded by the Accelerator (mixed precision, the backend's distributed type)."""

    @classmethod
    def create(
        cls,
        *,
        cpu: bool = False,
        backend: str | None = None,
        timeout: timedelta | None = None,
        init_method: str | None = None,
        debug: bool | None = None,
    ) -> _ProcessContext:
        cluster = _env.read_cluster_environment()
        launch = _env.launch_settings()
        cpu = cpu or bool(launch.get("use_cpu", False))
        if debug is None:
            debug = _env.debug_requested() or bool(launch.get("debug", False))
        device = _pick_device(cluster, cpu=cpu)
        if backend is not None:
            backend = validate_backend_name(backend, argument="PartialState(backend=...)")
        ray_train.check_process_group()  # inside Ray Train: join Ray's group, never train apart
        multi_process = cluster.world_size > 1 or dist.is_initialized()
        if multi_process:
            backend = backend or _default_backend(device)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            _process_group.init_default_group(
                cluster, backend=backend, timeout=timeout, init_method=init_method
            )
            cluster = _cluster_from_group(cluster)
        return cls(
            cluster=cluster,
            device=device,
            backend=backend if multi_process else None,
            distributed_type=_distributed_type(device, cluster.world_size),
            debug=debug,
        )


def _pick_device(cluster: _env.ClusterEnvironment, *, cpu: bool) -> torch.device:
    if cpu:
        return torch.device("cpu")
    override = _env.torch_device_override()
    if override is not None:  # Accelerate's variable; Ray Train names each worker's device with it
        return _parse_device_override(override)
    if torch.cuda.is_available():
        return torch.device("cuda", cluster.local_rank % torch.cuda.device_count())
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu", cluster.local_rank % torch.xpu.device_count())
    if torch.backends.mps.is_available() and cluster.world_size == 1:
        return torch.device("mps")
    return torch.device("cpu")


def _parse_device_override(value: str) -> torch.device:
    try:
        return torch.device(value)
    except RuntimeError:
        raise ValueError(
            f"{_env.ACCELERATE_TORCH_DEVICE}={value!r} is not a torch device. Name one such as 'cpu', "
            "'cuda:1' or 'xpu:0', or unset the variable to let lockstep pick the device from the local rank."
        ) from None


def _default_backend(device: torch.device) -> str:
    return {"cuda": "nccl", "xpu": "xccl"}.get(device.type, "gloo")


def _distributed_type(device: torch.device, world_size: int) -> DistributedType:
    if world_size <= 1:
        return DistributedType.NO
    return {"cuda": DistributedType.MULTI_GPU, "xpu": DistributedType.MULTI_XPU}.get(
        device.type, DistributedType.MULTI_CPU
    )


def _cluster_from_group(cluster: _env.ClusterEnvironment) -> _env.ClusterEnvironment:
    """Trust the live group over the environment (a user may have called init_process_group)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if (rank, world_size) == (cluster.rank, cluster.world_size):
        return cluster
    local_world = cluster.local_world_size if cluster.world_size == world_size else world_size
    return _env.ClusterEnvironment(
        source=cluster.source,
        rank=rank,
        local_rank=cluster.local_rank if cluster.world_size == world_size else rank,
        world_size=world_size,
        local_world_size=local_world,
        master_addr=cluster.master_addr,
        master_port=cluster.master_port,
        restart_count=cluster.restart_count,
    )


class PartialState:
    """The process topology, without any training settings.

    Args:
        cpu: run on the CPU even when an accelerator is present.
        **kwargs: ``backend``, ``timeout`` and ``init_method`` for the process group, and ``debug``.
            They take effect only for the first PartialState of the process.

    Example:
        >>> state = PartialState()
        >>> with state.main_process_first():
        ...     pass  # e.g. download or preprocess a data set once
    """

    _context: ClassVar[_ProcessContext | None] = None

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        unknown = set(kwargs) - {"backend", "timeout", "init_method", "debug"}
        if unknown:
            raise TypeError(
                f"PartialState() got unexpected keyword arguments {sorted(unknown)}; "
                "it accepts cpu, backend, timeout, init_method and debug."
            )
        if PartialState._context is None:
            PartialState._context = _ProcessContext.create(cpu=cpu, **kwargs)

    @classmethod
    def _reset_state(cls, destroy_process_group: bool = False) -> None:
        """Forget the shared state (for tests). Optionally tear the process group down too."""
        if destroy_process_group:
            _process_group.shutdown()
        PartialState._context = None

    @property
    def _ctx(self) -> _ProcessContext:
        if PartialState._context is None:
            raise RuntimeError("The process state was reset; create a new PartialState() first.")
        return PartialState._context

    # -- topology ---------------------------------------------------------------------------------
    @property
    def initialized(self) -> bool:
        return PartialState._context is not None

    @property
    def num_processes(self) -> int:
        return self._ctx.cluster.world_size

    @property
    def process_index(self) -> int:
        return self._ctx.cluster.rank

    @property
    def local_process_index(self) -> int:
        return self._ctx.cluster.local_rank

    @property
    def num_processes_per_node(self) -> int:
        return self._ctx.cluster.local_world_size

    @property
    def device(self) -> torch.device:
        return self._ctx.device

    @property
    def default_device(self) -> torch.device:
        return self._ctx.device

    @property
    def backend(self) -> str | None:
        return self._ctx.backend

    @property
    def distributed_type(self) -> DistributedType:
        return self._ctx.distributed_type

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    # -- what Accelerate asks of the distributed type: the one place outside config/ that reads its table ----
    @property
    def multi_device(self) -> bool:
        """Whether the processes are data parallel over accelerator devices, one per process (DDP on GPUs,
        XPUs or MPS): Accelerate's ``Accelerator.multi_device``. False on one process, for DDP on CPUs and for
        sharded training."""
        from lockstep.config import topology

        return self.use_distributed and topology.is_multi_device(self.distributed_type)

    @property
    def is_fsdp2(self) -> bool:
        """Whether models are sharded with FSDP2 (lockstep's FSDP is always FSDP2)."""
        from lockstep.config import topology

        return topology.is_fsdp2(self.distributed_type)

    @property
    def uses_deepspeed(self) -> bool:
        """Whether the distributed type is DeepSpeed's: what Accelerate's ``deepspeed_required`` asks."""
        from lockstep.config import topology

        return topology.is_deepspeed(self.distributed_type)

    @property
    def is_plain(self) -> bool:
        """Whether nothing beyond the process count was asked for (distributed type NO): no plugin, no
        layout, one process."""
        from lockstep.config import topology

        return topology.is_plain(self.distributed_type)

    @property
    def debug(self) -> bool:
        """Whether collectives first check that every rank passes tensors of the same shapes and dtypes."""
        return self._ctx.debug

    @debug.setter
    def debug(self, value: bool) -> None:
        # Shared by every PartialState and AcceleratorState of the process, as in Accelerate, whose tests
        # switch the operation checker on and off with `state.debug = True`.
        self._ctx.debug = bool(value)

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def fork_launched(self) -> bool:
        """Whether ``notebook_launcher`` forked this process."""
        return _env.fork_launched()

    @property
    def restart_count(self) -> int:
        """How many times the elastic agent restarted this job's workers."""
        return self._ctx.cluster.restart_count

    def __repr__(self) -> str:
        """Accelerate's text, e.g. ``Distributed environment: MULTI_CPU  Backend: gloo`` and one line each for
        the number of processes, this process's index and local index, and the device."""
        backend = f"  Backend: {self.backend}" if self.backend else ""
        return (
            f"Distributed environment: {self.distributed_type.value}{backend}\n"
            f"Num processes: {self.num_processes}\nProcess index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\nDevice: {self.device}\n"
        )

    # -- synchronisation --------------------------------------------------------------------------
    def wait_for_everyone(self) -> None:
        """Block until every process reaches this point (a barrier; no-op for one process)."""
        if self.use_distributed:
            dist.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the block on the main process first, then on the others."""
        yield from self._first(self.is_main_process)

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Run the block on each machine's local main process first, then on the others."""
        yield from self._first(self.is_local_main_process)

    def _first(self, is_first: bool) -> Iterator[None]:
        if not is_first:
            self.wait_for_everyone()
        yield
        if is_first:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Give each process its contiguous share of a list, tuple, dict of lists, or tensor.

        Args:
            inputs: the object to split (dict values are split key by key).
            apply_padding: repeat the last element so every process gets the same length.

        Example:
            >>> with PartialState().split_between_processes(["a", "b", "c"]) as mine:
            ...     print(mine)  # rank 0 of 2 gets ['a', 'b'], rank 1 gets ['c']
            ['a', 'b', 'c']
        """
        yield split_for_process(inputs, self.num_processes, self.process_index, apply_padding=apply_padding)

    # -- running code on some processes -----------------------------------------------------------
    def on_main_process(self, function: F) -> F:
        """Decorator: run ``function`` on the main process only (others get None)."""
        return _run_if(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: F) -> F:
        """Decorator: run ``function`` on the local main process of each machine only."""
        return _run_if(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: F) -> F:
        """Decorator: run ``function`` on the last process only."""
        return _run_if(function, lambda: self.is_last_process)

    def on_process(self, function: F | None = None, process_index: int | None = None) -> Any:
        """Decorator: run ``function`` on the process with global index ``process_index`` only.

        Example:
            >>> @PartialState().on_process(process_index=0)
            ... def report():
            ...     return "only rank 0"
        """
        if process_index is None:
            raise ValueError(
                "on_process() needs process_index=, the global rank that should run the function."
            )
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return _run_if(function, lambda: self.process_index == process_index)

    def on_local_process(self, function: F | None = None, local_process_index: int | None = None) -> Any:
        """Decorator: run ``function`` on the process with this local index on each machine."""
        if local_process_index is None:
            raise ValueError("on_local_process() needs local_process_index=.")
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return _run_if(function, lambda: self.local_process_index == local_process_index)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    def destroy_process_group(self, group: Any = None) -> None:
        """Tear down the process group safely (see :mod:`lockstep._process_group`)."""
        if group is not None:
            dist.destroy_process_group(group)
        else:
            _process_group.shutdown()


def _run_if(function: F, condition: Callable[[], bool]) -> F:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs) if condition() else None

    return wrapper  # type: ignore[return-value]


def split_for_process(inputs: Any, num_processes: int, index: int, *, apply_padding: bool = False) -> Any:
    """The contiguous share of ``inputs`` that process ``index`` of ``num_processes`` handles.

    The first ``len % num_processes`` processes get one extra element, as ``numpy.array_split`` does.
    """
    if isinstance(inputs, Mapping):
        lengths = {len(v) for v in inputs.values()}
        if len(lengths) > 1:
            raise ValueError(
                "split_between_processes() needs every value of a dict to have the same length, got "
                f"lengths { {k: len(v) for k, v in inputs.items()} }."
            )
        return {
            k: split_for_process(v, num_processes, index, apply_padding=apply_padding)
            for k, v in inputs.items()
        }
    if not hasattr(inputs, "__len__") or not hasattr(inputs, "__getitem__"):
        raise TypeError(
            f"split_between_processes() cannot split a {type(inputs).__name__}; pass a list, tuple, dict or tensor."
        )
    length = len(inputs)
    per_process, extras = divmod(length, num_processes)
    start = index * per_process + min(index, extras)
    end = start + per_process + (1 if index < extras else 0)
    share = inputs[start:end]
    if apply_padding and length > 0:
        target = math.ceil(length / num_processes)
        share = _pad_with_last(share, target, last=inputs[length - 1 : length])
    return share


def _pad_with_last(share: Any, target: int, *, last: Any) -> Any:
    missing = target - len(share)
    if missing <= 0:
        return share
    if isinstance(share, torch.Tensor):
        return torch.cat([share, *([last] * missing)])
    return share + type(share)(list(last) * missing)


class AcceleratorState(PartialState):
    """The process state plus the training settings an :class:`~lockstep.Accelerator` chose.

    ``deepspeed_plugin`` is the active ``DeepSpeedPlugin`` (None without DeepSpeed). Accelerate's members for
    integrations lockstep does not drive answer as Accelerate does when they are not configured:
    ``megatron_lm_plugin`` and ``torch_tp_plugin`` are None; ``parallelism_config`` and ``device_mesh`` are
    None unless the Accelerator was given a ``ParallelismConfig``;
    ``use_ipex`` is False.

    Args:
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``; recorded by the first Accelerator.
        cpu: run on the CPU even when an accelerator is present.
        **kwargs: process-group arguments, as for :class:`PartialState`.

    Example:
        >>> state = AcceleratorState()
        >>> state.deepspeed_plugin, state.use_ipex, state.is_fsdp2, state.dynamo_plugin.backend.value
        (None, False, False, 'no')
    """

    def __init__(self, mixed_precision: str | None = None, cpu: bool = False, **kwargs: Any) -> None:
        super().__init__(cpu, **kwargs)
        if mixed_precision is not None:
            self._record(mixed_precision=str(mixed_precision))

    @classmethod
    def is_set_up(cls) -> bool:
        """Whether an Accelerator (or an ``AcceleratorState(mixed_precision=...)``) recorded its settings."""
        return PartialState._context is not None and bool(PartialState._context.accelerator_settings)

    @property
    def mixed_precision(self) -> str:
        return self._ctx.accelerator_settings.get("mixed_precision", "no")

    # -- the plugins the Accelerator uses ---------------------------------------------------------
    @property
    def dynamo_plugin(self) -> Any:
        """The ``TorchDynamoPlugin`` models are compiled with (``backend="no"`` when they are not)."""
        plugin = self._ctx.accelerator_settings.get("dynamo_plugin")
        if plugin is None:
            from lockstep.config.plugins import TorchDynamoPlugin

            return TorchDynamoPlugin()
        return plugin

    @property
    def fsdp_plugin(self) -> Any:
        """The ``FullyShardedDataParallelPlugin`` of the FSDP backend, or None when models are not sharded."""
        return self._ctx.accelerator_settings.get("fsdp_plugin") if self.is_fsdp2 else None

    @property
    def use_ipex(self) -> bool:
        """False: lockstep does not use Intel Extension for PyTorch (Accelerate's answer without IPEX)."""
        return False

    @property
    def deepspeed_plugin(self) -> Any:
        """The active ``DeepSpeedPlugin``, or None when DeepSpeed is not used."""
        plugins = self.deepspeed_plugins
        if not plugins:
            return None
        return next((p for p in plugins.values() if p.selected), next(iter(plugins.values())))

    @property
    def deepspeed_plugins(self) -> dict[str, Any] | None:
        """The named ``DeepSpeedPlugin`` objects the Accelerator was given, or None."""
        return self._ctx.accelerator_settings.get("deepspeed_plugins")

    @property
    def megatron_lm_plugin(self) -> None:
        """None: lockstep does not drive Megatron-LM."""
        return None

    @property
    def torch_tp_plugin(self) -> None:
        """None: Accelerate's deprecated ``TorchTensorParallelPlugin`` is not built (tensor parallelism is
        configured with ``ParallelismConfig(tp_size=...)``)."""
        return None

    @property
    def parallelism_config(self) -> Any:
        """The Accelerator's ``ParallelismConfig`` (the N-D layout), or None."""
        return self._ctx.accelerator_settings.get("parallelism_config")

    @property
    def device_mesh(self) -> Any:
        """The ``ParallelismConfig``'s device mesh, or None without one (or when every size is 1 on one process)."""
        config = self.parallelism_config
        return None if config is None else config.device_mesh

    def get_deepspeed_plugin(self, name: str) -> Any:
        """The DeepSpeed plugin called ``name``.

        Raises:
            ValueError: DeepSpeed is not used, or no plugin has that name (the names are listed).
        """
        return self._deepspeed_plugins_with(name)[name]

    def select_deepspeed_plugin(self, name: str | None = None) -> None:
        """Make the plugin called ``name`` the active one: the next model prepared gets its engine."""
        plugins = self._deepspeed_plugins_with(name)
        for key, plugin in plugins.items():
            if key == name:
                plugin.select(_from_accelerator_state=True)
            else:
                plugin._unselect()

    def _deepspeed_plugins_with(self, name: str | None) -> dict[str, Any]:
        plugins = self.deepspeed_plugins
        if not plugins:
            raise ValueError(
                f"No DeepSpeed plugin called {name!r}: this Accelerator does not use DeepSpeed. Pass "
                "Accelerator(deepspeed_plugin={name: DeepSpeedPlugin(...)})."
            )
        if name not in plugins:
            raise ValueError(
                f"No DeepSpeed plugin called {name!r}; the plugins are {', '.join(map(repr, plugins))}."
            )
        return plugins

    @property
    def distributed_type(self) -> DistributedType:
        return self._ctx.accelerator_settings.get("distributed_type", super().distributed_type)

    @distributed_type.setter
    def distributed_type(self, distributed_type: DistributedType | str) -> None:
        """Record another distributed type, as Accelerate lets code do (tests, integrations). It changes what
        the state reports, not the backend an existing Accelerator already prepared objects with."""
        self._record(distributed_type=DistributedType.parse(distributed_type, argument="distributed_type"))

    def __repr__(self) -> str:
        """The process state's text plus ``Mixed precision type: ...``, as Accelerate prints it."""
        return super().__repr__() + f"Mixed precision type: {self.mixed_precision}\n"

    def _record(self, **settings: Any) -> None:
        self._ctx.accelerator_settings.update(settings)


class GradientState:
    """Gradient synchronisation state shared by the Accelerator, its dataloaders and its optimizers.

    ``sync_gradients`` is False on the micro-steps of gradient accumulation, where optimizers skip
    their step and DDP skips its all-reduce; ``end_of_dataloader`` and ``remainder`` describe the batch
    a prepared dataloader yielded last.
    """

    _shared: ClassVar[dict[str, Any]] = {}

    def __init__(self, gradient_accumulation_plugin: Any = None) -> None:
        self.__dict__ = GradientState._shared
        if not self.__dict__:
            self.sync_gradients = True
            self.active_dataloader: Any = None
            self.dataloader_references: list[Any] = [None]
            self.plugin_kwargs: dict[str, Any] = {
                "num_steps": 1,
                "adjust_scheduler": True,
                "sync_with_dataloader": True,
                "sync_each_batch": False,
            }
        if gradient_accumulation_plugin is not None:
            self.plugin_kwargs = gradient_accumulation_plugin.to_kwargs()

    @classmethod
    def _reset_state(cls) -> None:
        cls._shared.clear()

    @property
    def num_steps(self) -> int:
        return int(self.plugin_kwargs.get("num_steps") or 1)

    @property
    def adjust_scheduler(self) -> bool:
        return bool(self.plugin_kwargs.get("adjust_scheduler", True))

    @property
    def sync_with_dataloader(self) -> bool:
        return bool(self.plugin_kwargs.get("sync_with_dataloader", True))

    @property
    def sync_each_batch(self) -> bool:
        return bool(self.plugin_kwargs.get("sync_each_batch", False))

    @property
    def in_dataloader(self) -> bool:
        return self.active_dataloader is not None

    @property
    def end_of_dataloader(self) -> bool:
        return bool(self.active_dataloader is not None and self.active_dataloader.end_of_dataloader)

    @property
    def remainder(self) -> int:
        """Real samples in the last global batch (-1 when unknown)."""
        return -1 if self.active_dataloader is None else self.active_dataloader.remainder

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        self.sync_gradients = sync_gradients

    def _add_dataloader(self, dataloader: Any) -> None:
        self.active_dataloader = dataloader
        self.dataloader_references.append(dataloader)

    def _remove_dataloader(self, dataloader: Any) -> None:
        if dataloader in self.dataloader_references:
            self.dataloader_references.remove(dataloader)
        self.active_dataloader = self.dataloader_references[-1]

    def __repr__(self) -> str:
        return (
            f"Sync Gradients: {self.sync_gradients}\nAt end of current dataloader: {self.end_of_dataloader}\n"
            f"Extra samples added: {self.remainder}\nGradient accumulation plugin: {self.plugin_kwargs}\n"
        )
