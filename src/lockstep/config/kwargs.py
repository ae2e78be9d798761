"""``*Kwargs`` handlers: small dataclasses that tune one torch object the Accelerator creates.

Pass them in ``Accelerator(kwargs_handlers=[...])``. Each one is turned into keyword arguments for the
torch call it configures (``to_kwargs`` returns only the fields changed from their defaults).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

from lockstep.config.enums import DDPCommunicationHookType

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
    bucket_cap_mb: float | None = None
    """Gradient bucket size in MiB (torch's default, 25, when None)."""
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
