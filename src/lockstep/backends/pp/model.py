"""The prepared pipelined model: this rank's stages under the model's own parameter names, and their schedule.

:class:`PipelinedModel` is an ``nn.Module`` whose parameters, buffers and state dict are exactly those of
the stages this rank holds, under the names they have in the user's model (``layers.3.up.weight``), so
optimizers, clipping, ``torch.distributed.checkpoint`` and the FSDP checkpoint code see an ordinary
module. A training step is one call of the torch schedule (forward and backward of every micro-batch):
:meth:`PipelinedModel.train_step`, reached through ``accelerator.pipeline_step``. Calling the model
directly is an error that says so.

Gradients: each micro-batch's loss is divided by ``micro-batches x accumulation steps`` before its
backward (the schedule is built with ``scale_grads=False``, since torch's own scaling would also divide
gradients accumulated by earlier steps), so a step's gradients are those of the batch's mean loss, and an
accumulation cycle's those of the mean over its batches, as on one process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

_MISUSE = (
    "A pipelined model (ParallelismConfig(pp_size > 1)) is not called directly: each rank holds some stages "
    "only, and one training step runs forward and backward of every micro-batch through all of them. Call "
    "loss = accelerator.pipeline_step(model, inputs, target=labels) (the loss on the last stage, None on the "
    "others), then optimizer.step()."
)


class _ScaledLoss:
    """The user's loss function, divided by the number of micro-batch backwards one optimizer step sums."""

    def __init__(self) -> None:
        self.fn: Callable[..., torch.Tensor] | None = None
        self.divisor = 1

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        assert self.fn is not None
        return self.fn(output, target) / self.divisor


def _first_tensor(values: Any) -> torch.Tensor | None:
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
    return None


class PipelinedModel(nn.Module):
    """This rank's pipeline stages as one module with the original parameter names.

    Args:
        stages: this rank's ``PipelineStage`` objects, in stage order.
        schedule_class: the torch schedule class (``ScheduleGPipe``, ``Schedule1F1B``, ...).
        num_microbatches: micro-batches per batch.
        persistent_keys: the state-dict keys of the user's model, in its order (other buffers are non-persistent).
    """

    flat_optimizer_state = True
    """Checkpoints save the optimizer state flattened, one entry per parameter (see the FSDP checkpoint)."""

    def __init__(
        self,
        stages: Sequence[Any],
        *,
        schedule_class: type,
        num_microbatches: int,
        persistent_keys: list[str],
    ) -> None:
        super().__init__()
        self._stages = list(stages)  # a plain list: the stage modules are not children under another name
        self._schedule_class = schedule_class
        self.num_microbatches = num_microbatches
        self.key_order = list(persistent_keys)
        self._loss = _ScaledLoss()
        self._schedule: Any = None
        self._batch_size: int | None = None
        for stage in self._stages:
            _merge_into(self, stage.submod)
        _mark_non_persistent(self, set(persistent_keys))

    # -- what this rank holds ------------------------------------------------------------------------
    @property
    def stage_indices(self) -> list[int]:
        """The indices of the stages this rank holds."""
        return [stage.stage_index for stage in self._stages]

    @property
    def stage_modules(self) -> list[nn.Module]:
        """This rank's stage modules (torch ``GraphModule``s, FSDP-sharded with ``dp_shard_size > 1``)."""
        return [stage.submod for stage in self._stages]

    @property
    def holds_first_stage(self) -> bool:
        return any(stage.is_first for stage in self._stages)

    @property
    def holds_last_stage(self) -> bool:
        return any(stage.is_last for stage in self._stages)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(_MISUSE)

    def train(self, mode: bool = True) -> PipelinedModel:
        super().train(mode)
        for module in self.stage_modules:
            module.train(mode)
        return self

    # -- one training step ---------------------------------------------------------------------------
    def _built_schedule(self) -> Any:
        if self._schedule is None:
            from torch.distributed.pipelining.schedules import PipelineScheduleSingle

            single = issubclass(self._schedule_class, PipelineScheduleSingle)
            stages = self._stages[0] if single else self._stages
            self._schedule = self._schedule_class(
                stages, n_microbatches=self.num_microbatches, loss_fn=self._loss, scale_grads=False
            )
        return self._schedule

    def check_batch(self, args: tuple[Any, ...], target: Any) -> None:
        """Raise a ``ValueError`` when the batch cannot be cut into the micro-batches the stages expect."""
        tensor = _first_tensor((*args, target))
        if tensor is None:
            raise TypeError(
                "pipeline_step() got no tensor: pass the model's inputs (a tensor first) and target=labels."
            )
        size = tensor.shape[0]
        if size % self.num_microbatches:
            raise ValueError(
                f"pipeline_step() got a batch of {size} samples, which {self.num_microbatches} micro-batches do not "
                f"divide. Use a batch size that is a multiple of {self.num_microbatches} (drop_last=True in the "
                "DataLoader), or change TorchPipelineParallelConfig(num_microbatches=...)."
            )
        if self._batch_size is not None and size != self._batch_size:
            raise ValueError(
                f"pipeline_step() got a batch of {size} samples after batches of {self._batch_size}: the pipeline "
                "stages exchange micro-batches of one fixed shape. Keep the batch size fixed (drop_last=True in the "
                "DataLoader)."
            )
        self._batch_size = size

    def train_step(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        target: Any,
        loss_fn: Callable[..., torch.Tensor],
        accumulation_steps: int,
    ) -> torch.Tensor | None:
        """Forward and backward of every micro-batch of one batch; the batch's mean loss on the rank holding
        the last stage (None on the others). Gradients accumulate into ``.grad`` (see the module docs)."""
        self.check_batch(args, target)
        schedule = self._built_schedule()
        self._loss.fn = loss_fn
        self._loss.divisor = self.num_microbatches * accumulation_steps
        losses: list[torch.Tensor] = []
        first, last = self.holds_first_stage, self.holds_last_stage
        schedule.step(
            *(args if first else ()),
            target=target if last else None,
            losses=losses,
            return_outputs=False,
            **(kwargs if first else {}),
        )
        if not last:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum() * accumulation_steps


def _merge_into(shell: nn.Module, source: nn.Module) -> None:
    """Make ``shell`` hold ``source``'s parameters, buffers and submodules under the same names. A leaf
    module is shared as it is; a module with children gets a fresh container in ``shell`` (two stages may
    both hold parts of ``layers``), so no stage module is changed."""
    for name, parameter in source._parameters.items():
        if parameter is not None:
            assert name not in shell._parameters, f"two stages hold the parameter {name}"
            shell._parameters[name] = parameter
    for name, buffer in source._buffers.items():
        if buffer is not None:
            shell._buffers[name] = buffer
    for name, child in source._modules.items():
        if child is None:
            continue
        if not child._modules:
            assert name not in shell._modules, f"two stages hold the module {name}"
            shell._modules[name] = child
            continue
        container = shell._modules.get(name)
        if container is None:
            container = nn.Module()
            shell._modules[name] = container
        _merge_into(container, child)


def _mark_non_persistent(shell: nn.Module, persistent_keys: set[str]) -> None:
    """Buffers that the user's model does not save (e.g. rotary frequencies) stay out of the state dict."""
    for prefix, module in shell.named_modules():
        for name in module._buffers:
            key = f"{prefix}.{name}" if prefix else name
            if key not in persistent_keys:
                module._non_persistent_buffers_set.add(name)
