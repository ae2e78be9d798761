"""Mixed precision: autocast around the forward pass, gradient scaling for fp16.

Built on ``torch.autocast`` and ``torch.amp.GradScaler``; both work on CPU as well as CUDA
(``torch.cuda.amp.GradScaler`` silently disables itself on CPU, so it is never used here).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lockstep._nested import recursively_apply
from lockstep.config.enums import PrecisionType
from lockstep.config.kwargs import AutocastKwargs, GradScalerKwargs

_DTYPES = {PrecisionType.FP16: torch.float16, PrecisionType.BF16: torch.bfloat16}
_ORIGINAL_FORWARD = "_lockstep_original_forward"


def parse_mixed_precision(value: object) -> PrecisionType:
    """Validate a ``mixed_precision`` value (``"no"``, ``"fp16"``, ``"bf16"``)."""
    if isinstance(value, PrecisionType):
        precision = value
    else:
        text = str(value).strip().lower()
        precision = next((p for p in PrecisionType if p.value == text), None)  # type: ignore[assignment]
        if precision is None:
            raise ValueError(
                f"mixed_precision={value!r} is invalid: it must be one of 'no', 'fp16' or 'bf16'. "
                "Pass 'no' to train in full precision."
            )
    if precision == PrecisionType.FP8:
        raise ValueError(
            "mixed_precision='fp8' is not supported by lockstep yet: it needs an FP8 backend that is not "
            "built. Use 'bf16' (or 'fp16') instead."
        )
    return precision


def _to_fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float()


def _is_half(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.dtype in (torch.float16, torch.bfloat16)


def convert_outputs_to_fp32(outputs: Any) -> Any:
    """Cast every fp16/bf16 tensor in ``outputs`` back to fp32."""
    return recursively_apply(_to_fp32, outputs, test_type=_is_half)


class Precision:
    """Autocast and gradient scaling for one ``mixed_precision`` setting.

    Args:
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``.
        device: the device models run on (its type picks the autocast device).
        autocast_kwargs: ``AutocastKwargs`` from the user, if any.
        scaler_kwargs: ``GradScalerKwargs`` from the user, if any (fp16 only).
    """

    def __init__(
        self,
        mixed_precision: PrecisionType,
        device: torch.device,
        *,
        autocast_kwargs: AutocastKwargs | None = None,
        scaler_kwargs: GradScalerKwargs | None = None,
    ) -> None:
        self.mixed_precision = mixed_precision
        self.device_type = device.type
        self.autocast_kwargs = autocast_kwargs or AutocastKwargs()
        self.dtype = _DTYPES.get(mixed_precision)
        self.scaler: torch.amp.GradScaler | None = None
        if mixed_precision == PrecisionType.FP16:
            kwargs = (scaler_kwargs or GradScalerKwargs()).to_dict()
            self.scaler = torch.amp.GradScaler(self.device_type, **kwargs)

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    def autocast_context(
        self, autocast_handler: AutocastKwargs | None = None
    ) -> contextlib.AbstractContextManager:
        """A ``torch.autocast`` context for this precision (a null context in full precision)."""
        handler = autocast_handler or self.autocast_kwargs
        if not self.enabled or not handler.enabled:
            return contextlib.nullcontext()
        kwargs: dict[str, Any] = {"dtype": self.dtype}
        if handler.cache_enabled is not None:
            kwargs["cache_enabled"] = handler.cache_enabled
        return torch.autocast(device_type=self.device_type, **kwargs)

    def wrap_forward(self, model: nn.Module) -> None:
        """Run ``model.forward`` under autocast and return its outputs in fp32. Idempotent."""
        if not self.enabled or _ORIGINAL_FORWARD in model.__dict__:
            return
        original = model.forward
        context_factory = self.autocast_context

        @functools.wraps(original)
        def forward_in_mixed_precision(*args: Any, **kwargs: Any) -> Any:
            with context_factory():
                outputs = original(*args, **kwargs)
            return convert_outputs_to_fp32(outputs)

        setattr(model, _ORIGINAL_FORWARD, original)
        model.forward = forward_in_mixed_precision  # type: ignore[method-assign]

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, scaled under fp16."""
        if self.scaler is not None:
            self.scaler.scale(loss).backward(**kwargs)
        else:
            loss.backward(**kwargs)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients of ``optimizer`` by the loss scale (fp16 only; once per step)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)


def precision_for(request: Any, kind: type[Precision] = Precision) -> Precision:
    """The precision a backend trains with, from what the Accelerator resolved (a
    :class:`~lockstep.config.backend_specs.BackendRequest`): its mixed precision, device, autocast and
    scaler settings; ``kind`` is the class (a sharding backend's subclass derives its policy from it)."""
    return kind(
        request.mixed_precision,
        request.state.device,
        autocast_kwargs=request.autocast_kwargs,
        scaler_kwargs=request.scaler_kwargs,
    )


def remove_forward_wrapper(model: nn.Module) -> None:
    """Undo :meth:`Precision.wrap_forward` (used by ``unwrap_model(keep_fp32_wrapper=False)``)."""
    original: Callable[..., Any] | None = model.__dict__.pop(_ORIGINAL_FORWARD, None)
    if original is not None:
        if getattr(original, "__self__", None) is model and original.__func__ is type(model).forward:
            model.__dict__.pop("forward", None)
        else:
            model.forward = original  # type: ignore[method-assign]
