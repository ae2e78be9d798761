"""Local SGD: every process trains its own replica and the replicas are averaged every few steps.

Accelerate's ``accelerate.local_sgd.LocalSGD`` with the same constructor, attributes and loop. Inside the
``with`` block the model's backward passes do not all-reduce gradients (``accelerator.no_sync(model)``),
so each process takes optimizer steps on its own batches; every ``local_sgd_steps``-th call of
:meth:`LocalSGD.step`, and once more when the block ends, every parameter is replaced by its mean over the
processes. On one process there is nothing to average and the helper does nothing.

Zhang et al., "Parallel SGD: When does averaging help?" (2016); Stich, "Local SGD Converges Fast and
Communicates Little" (ICLR 2019).

Differences from Accelerate, on purpose:

* ``local_sgd_steps`` below 1 is a ``ValueError`` when the helper is enabled (Accelerate divides by it in
  ``step()``); it may be None when disabled, as Accelerate's example passes.
* The block's final average is skipped when it ends with an exception: a process that failed alone would
  otherwise wait in a collective its peers never join, and its traceback would only show at the timeout.
* The parameters are averaged with one all-reduce per dtype (Accelerate: one per parameter) and written
  in place, so the parameter objects the optimizer holds are kept.
* The models that cannot be averaged are refused by what the backend does (sharded ``DTensor`` parameters,
  pipeline stages, an engine that keeps its own master weights) rather than by the distributed type.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from types import TracebackType
from typing import TYPE_CHECKING

import torch
from torch import nn

from lockstep.backends.capabilities import JointPreparation, PipelineSchedule

if TYPE_CHECKING:
    from lockstep.accelerator import Accelerator

__all__ = ["LocalSGD"]


class LocalSGD:
    """Train each process's replica on its own and average the parameters every ``local_sgd_steps`` steps.

    Args:
        accelerator: the Accelerator the model was prepared with.
        model: the prepared model whose parameters are averaged.
        local_sgd_steps: how many calls of :meth:`step` between two averages.
        enabled: False turns the helper off (no ``no_sync``, no averaging); it is off on one process too.

    Raises:
        NotImplementedError: for a model whose processes do not each hold whole plain parameters
            (FSDP, tensor or pipeline parallelism, DeepSpeed).
        ValueError: for ``local_sgd_steps`` below 1 while enabled.

    Example:
        >>> from lockstep import Accelerator
        >>> accelerator = Accelerator(cpu=True)
        >>> model = accelerator.prepare(torch.nn.Linear(2, 1))
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=4) as local_sgd:
        ...     for _ in range(8):
        ...         accelerator.backward(model(torch.ones(3, 2)).sum())
        ...         optimizer.step()
        ...         optimizer.zero_grad()
        ...         local_sgd.step()  # averages after steps 4 and 8 on several processes
        >>> local_sgd.num_steps
        8
    """

    def __init__(
        self, accelerator: Accelerator, model: nn.Module, local_sgd_steps: int, enabled: bool = True
    ) -> None:
        _refuse_unsupported(accelerator, model)
        self.enabled = bool(enabled) and accelerator.num_processes > 1
        if self.enabled:
            _check_steps(local_sgd_steps)
        self.num_steps = 0
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self._no_sync: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync = self.accelerator.no_sync(self.model)
            self._no_sync.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self.enabled or self._no_sync is None:
            return
        no_sync, self._no_sync = self._no_sync, None
        try:
            if exc_type is None:
                self._sync_and_avg_model_params()
        finally:
            no_sync.__exit__(exc_type, exc_value, traceback)

    def step(self) -> None:
        """Count one training step; every ``local_sgd_steps``-th one averages the parameters."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._sync_and_avg_model_params()

    def _sync_and_avg_model_params(self) -> None:
        """Replace every parameter by its mean over the processes (one all-reduce per dtype)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
        for param in self.model.parameters():
            by_dtype[param.dtype].append(param)
        with torch.no_grad():
            for params in by_dtype.values():
                flat = torch.cat([param.detach().reshape(-1) for param in params])
                mean = self.accelerator.reduce(flat, reduction="mean")
                offset = 0
                for param in params:
                    count = param.numel()
                    param.copy_(mean[offset : offset + count].view_as(param))
                    offset += count


def _check_steps(local_sgd_steps: object) -> None:
    if isinstance(local_sgd_steps, bool) or not isinstance(local_sgd_steps, int):
        raise TypeError(
            f"LocalSGD(local_sgd_steps={local_sgd_steps!r}) is invalid: it must be an int, the number of "
            "step() calls between two averages of the parameters. Pass e.g. local_sgd_steps=8, or "
            "enabled=False to train without LocalSGD."
        )
    if local_sgd_steps < 1:
        raise ValueError(
            f"LocalSGD(local_sgd_steps={local_sgd_steps}) is invalid: it must be >= 1 (the number of step() "
            "calls between two averages of the parameters). Pass 1 to average after every step, or "
            "enabled=False to train without LocalSGD."
        )


def _refuse_unsupported(accelerator: Accelerator, model: nn.Module) -> None:
    """Raise unless every process holds the whole model as plain tensors that it updates itself."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"LocalSGD(model={type(model).__name__}) is invalid: it must be the torch.nn.Module returned by "
            "accelerator.prepare(model)."
        )
    reason = _why_not_averageable(accelerator, model)
    if reason is not None:
        raise NotImplementedError(
            f"LocalSGD(model={type(model).__name__}) on an Accelerator with distributed_type="
            f"{accelerator.distributed_type} is not supported: {reason}. LocalSGD averages whole replicas "
            "of the model, as in Accelerate (CPUs and GPUs with plain data parallelism, no FSDP, DeepSpeed "
            "or model parallelism); prepare the model without sharding to use it."
        )


def _why_not_averageable(accelerator: Accelerator, model: nn.Module) -> str | None:
    if accelerator.capability(JointPreparation) is not None:
        return "the model and its optimizer are one engine that keeps its own copy of the weights"
    if accelerator.capability(PipelineSchedule) is not None:
        return "each process holds a different stage of the model (pipeline parallelism)"
    for name, param in model.named_parameters():
        if type(param.data) is not torch.Tensor:
            return (
                f"parameter {name!r} is a {type(param.data).__name__}, not a plain tensor (sharded "
                "over processes by FSDP or tensor parallelism)"
            )
    return None
