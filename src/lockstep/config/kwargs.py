"""``*Kwargs`` handlers: small dataclasses that tune one torch object the Accelerator creates.

Pass them in ``Accelerator(kwargs_handlers=[...])``. Each one is turned into keyword arguments for the
torch call it configures (``to_kwargs`` returns only the fields changed from their defaults).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from lockstep.config.enums import DDPCommunicationHookType, StrEnumBase

if TYPE_CHECKING:
    import torch.profiler

KNOWN_BACKENDS = ("nccl", "gloo", "mpi", "ucc", "xccl", "hccl", "cncl", "mccl", "smddp", "ccl")


@dataclass
class KwargsHandler:
    """Base of the ``*Kwargs`` classes."""

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.__dict__)

    def to_kwargs(self) -> dict[str, Any]:
        """The fields whose value differs from the class default."""
        default = self.__class__()
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        }


@dataclass(kw_only=True)
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments for ``torch.nn.parallel.DistributedDataParallel``.

    Example:
        >>> handler = DistributedDataParallelKwargs(find_unused_parameters=True)
        >>> # accelerator = Accelerator(kwargs_handlers=[handler])
    """

    dim: int = 0
    """Dimension along which inputs are scattered (DDP's ``dim``)."""
    broadcast_buffers: bool = True
    """Broadcast module buffers from rank 0 at the start of each forward."""
    bucket_cap_mb: float | None = 25
    """Gradient bucket size in MiB (25, torch's default, as in Accelerate; None also leaves torch's default)."""
    find_unused_parameters: bool = False
    """Traverse the autograd graph to find parameters that got no gradient."""
    check_reduction: bool = False
    """Deprecated in torch; accepted and ignored for compatibility."""
    gradient_as_bucket_view: bool = False
    """Let gradients be views into the all-reduce buckets (saves memory)."""
    static_graph: bool = False
    """Tell DDP that the set of used parameters never changes."""
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    """A built-in communication hook: ``no``, ``fp16``, ``bf16``, ``power_sgd``, ``batched_power_sgd``."""
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    """Compression wrapper around ``comm_hook`` (``fp16`` or ``bf16``)."""
    comm_state_option: dict[str, Any] = field(default_factory=dict)
    """Options for the PowerSGD state (e.g. ``{"matrix_approximation_rank": 2}``)."""

    def __post_init__(self) -> None:
        self.comm_hook = DDPCommunicationHookType.parse(self.comm_hook, argument="comm_hook")
        self.comm_wrapper = DDPCommunicationHookType.parse(self.comm_wrapper, argument="comm_wrapper")
        if self.comm_wrapper not in (DDPCommunicationHookType.NO, "fp16", "bf16"):
            raise ValueError(
                f"DistributedDataParallelKwargs(comm_wrapper={self.comm_wrapper.value!r}) is invalid: "
                "a wrapper must be 'no', 'fp16' or 'bf16'."
            )
        if self.bucket_cap_mb is not None and self.bucket_cap_mb <= 0:
            raise ValueError(
                f"DistributedDataParallelKwargs(bucket_cap_mb={self.bucket_cap_mb}) is invalid: it must be > 0."
            )

    def ddp_constructor_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the DDP constructor (the hook fields are applied after wrapping)."""
        kwargs: dict[str, Any] = {
            "dim": self.dim,
            "find_unused_parameters": self.find_unused_parameters,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            "static_graph": self.static_graph,
        }
        if self.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = self.bucket_cap_mb
        if not self.broadcast_buffers:
            # Only the non-default value is passed: torch >= 2.13 deprecates the argument itself.
            kwargs["broadcast_buffers"] = False
        return kwargs


@dataclass(kw_only=True)
class GradScalerKwargs(KwargsHandler):
    """Arguments for ``torch.amp.GradScaler`` (used with ``mixed_precision="fp16"``)."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass(kw_only=True)
class InitProcessGroupKwargs(KwargsHandler):
    """Arguments for ``torch.distributed.init_process_group``.

    Example:
        >>> from datetime import timedelta
        >>> handler = InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=60))
    """

    backend: str | None = None
    """Collective backend; None picks ``nccl`` on CUDA and ``gloo`` on CPU."""
    init_method: str | None = None
    """A ``tcp://host:port`` or ``file://`` URL; None uses the launcher's environment."""
    timeout: timedelta | None = None
    """How long a collective may wait before failing (torch's default is 30 minutes)."""

    def __post_init__(self) -> None:
        if self.backend is not None:
            self.backend = validate_backend_name(self.backend, argument="InitProcessGroupKwargs(backend=...)")
        if isinstance(self.timeout, (int, float)) and not isinstance(self.timeout, bool):
            self.timeout = timedelta(seconds=self.timeout)
        if self.timeout is not None and not isinstance(self.timeout, timedelta):
            raise TypeError(
                f"InitProcessGroupKwargs(timeout={self.timeout!r}) is invalid: pass a datetime.timedelta "
                "or a number of seconds."
            )
        if self.timeout is not None and self.timeout.total_seconds() <= 0:
            raise ValueError(
                f"InitProcessGroupKwargs(timeout={self.timeout}) is invalid: it must be positive."
            )


@dataclass(kw_only=True)
class AutocastKwargs(KwargsHandler):
    """Arguments for ``torch.autocast`` under mixed precision."""

    enabled: bool = True
    cache_enabled: bool | None = None


PROFILER_ACTIVITIES = ("cpu", "cuda", "xpu", "mtia", "hpu")
"""The ``ProfileKwargs.activities`` names (torch's ``ProfilerActivity`` members, lower-cased)."""
_SCHEDULE_KEYS = ("wait", "warmup", "active", "repeat", "skip_first", "skip_first_wait")
_REQUIRED_SCHEDULE_KEYS = ("wait", "warmup", "active")
PROFILE_PATTERN_NAME = "profile_{suffix}.json"
"""Accelerate's name pattern for profiler traces: one per process in ``ProfileKwargs.output_trace_dir``."""


@dataclass(kw_only=True)
class ProfileKwargs(KwargsHandler):
    """Settings of ``torch.profiler.profile`` for ``Accelerator.profile()``.

    Example:
        >>> handler = ProfileKwargs(activities=["cpu"], record_shapes=True, output_trace_dir="traces")
        >>> handler.to_kwargs()
        {'activities': ['cpu'], 'record_shapes': True, 'output_trace_dir': 'traces'}
        >>> ProfileKwargs(activities=["gpu"])
        Traceback (most recent call last):
        ValueError: ProfileKwargs(activities=['gpu']) is invalid: 'gpu' is not a profiler activity. Use cpu, cuda, xpu, mtia, hpu.
    """

    activities: list[str] | None = None
    """What to record: ``"cpu"`` (operators), ``"cuda"``, ``"xpu"``, ``"mtia"``, ``"hpu"`` (device kernels);
    None records the CPU and every available device."""
    schedule_option: dict[str, int] | None = None
    """``torch.profiler.schedule`` arguments: skip ``skip_first`` steps, then cycles of ``wait`` idle,
    ``warmup`` and ``active`` recorded steps (``repeat`` cycles, 0 = until the end); ``prof.step()`` counts a
    step. None records everything."""
    on_trace_ready: Callable[..., Any] | None = None
    """Called with the profiler each time a scheduled ``active`` window ends."""
    record_shapes: bool = False
    """Record the input shapes of operators."""
    profile_memory: bool = False
    """Record tensor memory allocation and release."""
    with_stack: bool = False
    """Record the source file and line of operators."""
    with_flops: bool = False
    """Estimate the FLOPs of matrix multiplications and convolutions."""
    with_modules: bool = False
    """Record the module hierarchy of operators."""
    output_trace_dir: str | None = None
    """Write a Chrome trace per process (``profile_<rank>.json``) to this folder when the block ends."""

    def __post_init__(self) -> None:
        if self.activities is not None:
            self.activities = [_activity_name(a, self.activities) for a in self.activities]
        if self.schedule_option is not None:
            _check_schedule(self.schedule_option)
        if self.on_trace_ready is not None and not callable(self.on_trace_ready):
            raise TypeError(
                f"ProfileKwargs(on_trace_ready={self.on_trace_ready!r}) is invalid: pass a function that takes "
                "the profiler, or None."
            )

    def build(self) -> torch.profiler.profile:
        """A ``torch.profiler.profile`` with these settings (not started).

        Raises:
            ValueError: an activity whose device is not available on this machine.
        """
        import torch.profiler

        activities = None
        if self.activities is not None:
            activities = [_profiler_activity(name) for name in self.activities]
        schedule = None if self.schedule_option is None else torch.profiler.schedule(**self.schedule_option)
        return torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )


def _activity_name(activity: Any, given: list[Any]) -> str:
    name = str(getattr(activity, "name", activity)).lower()
    if name not in PROFILER_ACTIVITIES:
        raise ValueError(
            f"ProfileKwargs(activities={given!r}) is invalid: {activity!r} is not a profiler activity. "
            f"Use {', '.join(PROFILER_ACTIVITIES)}."
        )
    return name


def _check_schedule(option: dict[str, int]) -> None:
    unknown = [key for key in option if key not in _SCHEDULE_KEYS]
    missing = [key for key in _REQUIRED_SCHEDULE_KEYS if key not in option]
    if unknown or missing:
        problem = f"unknown keys {unknown}" if unknown else f"{', '.join(missing)} missing"
        raise ValueError(
            f"ProfileKwargs(schedule_option={option!r}) is invalid: {problem}. It takes wait, warmup and active "
            "(and optionally repeat, skip_first, skip_first_wait), as torch.profiler.schedule does."
        )
    for key, value in option.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"ProfileKwargs(schedule_option={option!r}) is invalid: {key} must be an integer >= 0."
            )
    if option["active"] < 1:
        raise ValueError(
            f"ProfileKwargs(schedule_option={option!r}) is invalid: active must be >= 1 (no step would be recorded)."
        )


def _profiler_activity(name: str) -> torch.profiler.ProfilerActivity:
    """torch's activity for ``name``; device activities other than CUDA need their device (as in Accelerate)."""
    import torch

    available = {"cpu": True, "cuda": True}
    available["xpu"] = hasattr(torch, "xpu") and torch.xpu.is_available()
    available["mtia"] = hasattr(torch, "mtia") and torch.mtia.is_available()
    available["hpu"] = hasattr(torch, "hpu") and torch.hpu.is_available()
    if not available[name]:
        raise ValueError(
            f"ProfileKwargs(activities=[..., {name!r}]): there is no {name} device on this machine. "
            "Profile the devices this machine has (cpu, cuda)."
        )
    return getattr(torch.profiler.ProfilerActivity, name.upper())


class FP8BackendType(StrEnumBase):
    """The library that runs FP8 training (Accelerate's ``accelerate.utils.dataclasses.FP8BackendType``).

    lockstep has no FP8 backend, so ``Accelerator.fp8_backend`` is always ``NO``; the other values exist so
    that code comparing against them runs.
    """

    NO = "NO"
    TE = "TE"
    MSAMP = "MSAMP"
    AO = "AO"


def validate_backend_name(backend: str, *, argument: str) -> str:
    """Return ``backend`` lower-cased, or raise a ValueError naming the known backends.

    Composite specs such as ``cpu:gloo,cuda:nccl`` are accepted when every part is known.
    """
    text = str(backend).strip().lower()
    parts = [p.split(":", 1)[-1] for p in text.split(",")]
    unknown = [p for p in parts if p not in KNOWN_BACKENDS]
    if not text or unknown:
        raise ValueError(
            f"{argument} got backend {backend!r}, which is not a torch.distributed backend. "
            f"Use one of {', '.join(KNOWN_BACKENDS)} (gloo for CPU, nccl for NVIDIA GPUs)."
        )
    return text
