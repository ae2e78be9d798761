"""The prepared pipelined model: this rank's stages under the model's own parameter names, and their schedule.

:class:`PipelinedModel` is an ``nn.Module`` whose parameters, buffers and state dict are exactly those of
the stages this rank holds, under the names they have in the user's model (``layers.3.up.weight``), so
optimizers, clipping, ``torch.distributed.checkpoint`` and the FSDP checkpoint code see an ordinary
module. A training step is one call of the torch schedule (forward and backward of every micro-batch):
:meth:`PipelinedModel.train_step`, reached through ``accelerator.pipeline_step``.

Evaluation is an ordinary call: in ``model.eval()`` mode or under ``torch.no_grad()``, ``model(inputs)`` runs
the schedule forward only (torch's ``schedule.eval``) and returns the last stage's outputs on *every* rank
of the pipeline (broadcast over ``pp``), so ``accelerator.gather_for_metrics(outputs)``, which gathers over
the data-parallel replicas only, counts each sample once. Calling the model in training mode with
gradients enabled is an error that points to ``pipeline_step``.

``model.train()`` and ``model.eval()`` switch every module of this rank's stages, and dropout and batch
norm follow them (the stages are traced in training mode and their mode-dependent operators read the
module's flag at run time: :mod:`.modes`). The running statistics of a batch norm are those of one process
running the micro-batches in order (torch's shape pass, a real forward, leaves them alone). Stages built by
``prepare_pippy`` are traced in the mode the model had: with modules of :data:`MODE_DEPENDENT` they run only
in that mode; the other mode is a clear ``NotImplementedError``.

A model built on the meta device (see :mod:`.meta_init`) comes with its tensors empty: until they are
loaded or initialised (:meth:`PipelinedModel.init_weights`), a step is refused on every rank.

Gradients: each micro-batch's loss is divided by ``micro-batches x accumulation steps`` before its
backward (the schedule is built with ``scale_grads=False``, since torch's own scaling would also divide
gradients accumulated by earlier steps), so a step's gradients are those of the batch's mean loss, and an
accumulation cycle's those of the mean over its batches, as on one process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_MISUSE = (
    "A pipelined model (ParallelismConfig(pp_size > 1)) is not called directly for training: each rank holds "
    "some stages only, and one training step runs forward and backward of every micro-batch through all of "
    "them. Call loss = accelerator.pipeline_step(model, inputs, target=labels) (the loss on the last stage, "
    "None on the others), then optimizer.step(). To evaluate, call model.eval() (or use torch.no_grad()) "
    "first: model(inputs) then returns the outputs on every rank."
)

MODE_DEPENDENT: tuple[type[nn.Module], ...] = (
    nn.modules.dropout._DropoutNd,
    nn.modules.batchnorm._BatchNorm,
    nn.MultiheadAttention,
    nn.RNNBase,
)
"""Module classes that behave differently in ``train()`` and ``eval()`` mode (counted when their dropout
probability is > 0, for those that have one)."""


_NO_EVAL = {"ScheduleZBVZeroBubble": "zbv_zero_bubble"}
"""Schedules whose ``eval()`` fails in torch 2.13 (the ZBV runtime asserts it has no backward)."""


def mode_dependent_modules(model: nn.Module) -> list[str]:
    """The names of ``model``'s modules whose behaviour depends on train/eval mode (see the module docs)."""
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, MODE_DEPENDENT):
            continue
        probability = getattr(module, "p", getattr(module, "dropout", 0.0))
        if isinstance(module, nn.modules.batchnorm._BatchNorm) or probability:
            names.append(name)
    return names


class _ScaledLoss:
    """The user's loss function, divided by the number of micro-batch backwards one optimizer step sums."""

    def __init__(self) -> None:
        self.fn: Callable[..., torch.Tensor] | None = None
        self.divisor = 1
        self.evaluating = False
        """Forward only: torch's schedules still call the loss function on the last stage (with a placeholder
        target), so it returns a constant instead of reading labels the evaluation does not have."""

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        if self.evaluating:
            return torch.zeros(())
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
        group: the ``pp`` process group the stages exchange activations on.
        last_stage_rank: the rank in ``group`` that holds the last stage (its outputs are broadcast from there).
        training: the model's train/eval mode at ``prepare`` (the stage modules carry their own already).
        mode_dependent: names of modules whose mode the tracer baked into the stages
            (:func:`mode_dependent_modules`): the model then runs in ``training``'s mode only.
        eval_batch_size: the evaluation batch size, when known before the first evaluation (the traced one,
            for pipelined inference); smaller batches are padded to it.
        built_on_meta: the user's model was built on the meta device (its stages materialised empty).
        source_modules: the user's (meta) model's modules by name, run by :meth:`init_weights`.
        uninitialised: names of this rank's tensors that were materialised empty and hold no values yet.
    """

    flat_optimizer_state = True
    """Checkpoints save the optimizer state flattened, one entry per parameter (see the FSDP checkpoint)."""

    holds_part_of_the_model = True
    """Only this rank's stages are here: ``load_checkpoint_in_model`` reads just their tensors into them."""

    def __init__(
        self,
        stages: Sequence[Any],
        *,
        schedule_class: type,
        num_microbatches: int,
        persistent_keys: list[str],
        group: dist.ProcessGroup,
        last_stage_rank: int,
        training: bool = True,
        mode_dependent: Sequence[str] = (),
        eval_batch_size: int | None = None,
        built_on_meta: bool = False,
        uninitialised: Sequence[str] = (),
        source_modules: dict[str, nn.Module] | None = None,
    ) -> None:
        super().__init__()
        self._stages = list(stages)  # a plain list: the stage modules are not children under another name
        self._schedule_class = schedule_class
        self.num_microbatches = num_microbatches
        self.key_order = list(persistent_keys)
        self._loss = _ScaledLoss()
        self._schedule: Any = None
        self._batch_sizes: dict[
            bool, int
        ] = {}  # per kind of step (with backward or not): its fixed batch size
        if eval_batch_size is not None:
            self._batch_sizes[False] = eval_batch_size
        self._group = group
        self._last_stage_rank = last_stage_rank
        self._traced_training = training
        self._mode_dependent = list(mode_dependent)
        for stage in self._stages:
            _merge_into(self, stage.submod)
        _mark_non_persistent(self, set(persistent_keys))
        self.training = training  # not train(): the stage modules keep the modes the user's modules had
        self._materialised = list(uninitialised)  # in the model's order, for messages
        self._uninitialised = set(uninitialised)
        self._unchecked = built_on_meta  # every rank's tensors are checked once before the first step
        self._source_modules = source_modules or {}  # a plain dict: not submodules of this one
        self.register_load_state_dict_post_hook(_mark_loaded)

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

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group the stages exchange activations on."""
        return self._group

    @property
    def stage_device(self) -> torch.device:
        """The device this rank's stages run on."""
        return self._stages[0].device

    @property
    def eval_batch_size(self) -> int | None:
        """The batch size evaluations run with (smaller batches are padded to it); None before the first."""
        return self._batch_sizes.get(False)

    @property
    def schedule(self) -> Any:
        """The torch schedule object (``ScheduleGPipe``, ...), built on first use."""
        return self._built_schedule()

    # -- weights of a model built on the meta device ------------------------------------------------
    @property
    def uninitialised_weights(self) -> list[str]:
        """Names of this rank's tensors materialised from the meta device that hold no values yet."""
        return [name for name in self._materialised if name in self._uninitialised]

    def init_weights(self, fn: Callable[[nn.Module], None] | None = None, *, seed: int = 0) -> None:
        """Initialise the weights of this rank's stages in place (a model built on the meta device).

        Each stage draws from the seed ``seed + stage index`` (the caller's random stream is left as it
        was). The modules of the model given to ``prepare`` that own tensors of this rank's stages are run
        in the model's order, holding those tensors: ``fn(module)`` (which then answers for all their
        tensors), or, without ``fn``, the module's own ``reset_parameters()``. The weights follow
        the modules' initialisation but are not those one process building the whole model would draw
        (another random stream per stage); load a weights file for that. Stages sharded over
        ``dp_shard`` get the same weights: each module initialises whole tensors, each rank keeps its shard.

        Args:
            fn: a function initialising one module in place (e.g. a transformers ``_init_weights``).
            seed: the base random seed.

        Example:
            >>> with lockstep.init_empty_weights():  # doctest: +SKIP
            ...     model = MyModel()
            >>> model = accelerator.prepare(model)  # doctest: +SKIP
            >>> model.init_weights(seed=0)  # doctest: +SKIP
        """
        from lockstep.backends.pp.meta_init import init_stage_weights

        if not self._source_modules:
            raise RuntimeError(
                "init_weights() initialises a pipelined model that was built on the meta device; this one was "
                "prepared from real weights, which it keeps. Build the model under lockstep.init_empty_weights() "
                "to initialise its stages after prepare()."
            )
        stages = [(stage.stage_index, stage.submod) for stage in self._stages]
        self._uninitialised -= init_stage_weights(stages, self._source_modules, fn, seed)

    def _check_initialised(self, what: str) -> None:
        """Refuse a step on every rank while some rank's tensors hold no values (a collective, once)."""
        if not self._unchecked:
            return
        from lockstep.backends.pp.meta_init import uninitialised_report

        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.uninitialised_weights)
        report = uninitialised_report(gathered, what)
        if report is not None:
            raise RuntimeError(report)
        self._unchecked = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Forward only, in ``eval()`` mode or under ``torch.no_grad()``: the outputs on every pipeline rank."""
        if self.training and torch.is_grad_enabled():
            raise RuntimeError(_MISUSE)
        return self.eval_step(args, kwargs)

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

    def _check_mode(self, what: str) -> None:
        if self._mode_dependent and self.training != self._traced_training:
            traced, now = ("train", "eval") if self._traced_training else ("eval", "train")
            raise NotImplementedError(
                f"{what} in {now}() mode is not built yet for this pipelined model: the stages were traced in "
                f"{traced}() mode, and the tracer baked that mode into {', '.join(self._mode_dependent[:5])} "
                f"(their behaviour depends on the mode). Set their dropout to 0 (BatchNorm: use LayerNorm), or "
                f"run the model in {traced}() mode only."
            )

    def check_batch(self, args: tuple[Any, ...], target: Any, *, backward: bool = True) -> None:
        """Raise a ``ValueError`` when the batch cannot be cut into the micro-batches the stages expect."""
        tensor = _first_tensor((*args, target))
        if tensor is None:
            raise TypeError(
                "pipeline_step() got no tensor: pass the model's inputs (a tensor first) and target=labels."
            )
        self.check_batch_size(tensor.shape[0], backward=backward)

    def check_batch_size(self, size: int, *, backward: bool = True) -> None:
        """:meth:`check_batch` for a batch of ``size`` samples."""
        what = "pipeline_step()" if backward else "Evaluation (model(inputs))"
        if size % self.num_microbatches:
            raise ValueError(
                f"{what} got a batch of {size} samples, which {self.num_microbatches} micro-batches do not "
                f"divide. Use a batch size that is a multiple of {self.num_microbatches} (drop_last=True in the "
                "DataLoader), or change TorchPipelineParallelConfig(num_microbatches=...)."
            )
        fixed = self._batch_sizes.get(backward)
        if fixed is not None and size != fixed:
            hint = (
                "Keep the batch size fixed (drop_last=True in the DataLoader)."
                if backward
                else "Smaller batches are padded, larger ones are not: evaluate with one batch size."
            )
            raise ValueError(
                f"{what} got a batch of {size} samples after batches of {fixed}: the pipeline stages exchange "
                f"micro-batches of one fixed shape. {hint}"
            )
        self._batch_sizes[backward] = size

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
        self._check_mode("pipeline_step()")
        self._check_initialised("pipeline_step()")
        first, last = self.holds_first_stage, self.holds_last_stage
        if first or last:  # the inputs are read on the first stage only, the target on the last only
            self.check_batch((*args, *kwargs.values()) if first else (), target if last else None)
        schedule = self._built_schedule()
        self._loss.fn = loss_fn
        self._loss.divisor = self.num_microbatches * accumulation_steps
        self._batch_sizes.pop(False, None)  # the schedule re-infers the shapes at the next evaluation
        losses: list[torch.Tensor] = []
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

    def eval_step(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        batch_size: int | None = None,
        outputs_everywhere: bool = True,
    ) -> Any:
        """Forward of every micro-batch (torch's ``schedule.eval``, no backward, no loss); the last stage's
        outputs, merged along the batch. A batch smaller than the first evaluation batch (a loader's last)
        is padded to that size with its last sample, and the outputs cut back, because the stages exchange
        micro-batches of one fixed shape.

        Args:
            args: the positional inputs (read on the rank holding the first stage).
            kwargs: the keyword inputs (read there too).
            batch_size: the batch's sample count, for ranks that are not given the inputs; by default the
                first dimension of the first input tensor.
            outputs_everywhere: broadcast the outputs to every rank of the pipeline; when False, the rank
                holding the last stage returns them and the others return None.
        """
        self._check_mode("Evaluation (model(inputs))")
        self._check_initialised("Evaluation (model(inputs))")
        if self._schedule_class.__name__ in _NO_EVAL:
            raise NotImplementedError(
                f"Evaluation (model(inputs)) with TorchPipelineParallelConfig(schedule="
                f"{_NO_EVAL[self._schedule_class.__name__]!r}) is not built yet: torch {torch.__version__}'s "
                "forward-only run of this schedule still performs its backward actions and fails. Evaluate with "
                "another schedule (e.g. 'interleaved_zero_bubble')."
            )
        if batch_size is None:
            first = _first_tensor((*args, *kwargs.values()))
            if first is None:
                raise TypeError("Evaluation (model(inputs)) got no tensor: pass the model's inputs.")
            batch_size = first.shape[0]
        fixed = self._batch_sizes.get(False)
        padded = fixed is not None and batch_size < fixed
        if padded:
            args, kwargs = pad_batch((args, kwargs), batch_size, fixed)  # type: ignore[arg-type]
        self.check_batch_size(fixed if padded else batch_size, backward=False)  # type: ignore[arg-type]
        outputs = self._run_eval(args, kwargs)
        if outputs_everywhere:
            outputs = broadcast_outputs(outputs, self._group, self._last_stage_rank, self._stages[0].device)
        elif not self.holds_last_stage:
            return None
        return _cut_batch(outputs, fixed, batch_size) if padded else outputs  # type: ignore[arg-type]

    def _run_eval(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One forward-only run of the schedule; the merged outputs on the last stage's rank."""
        schedule = self._built_schedule()
        placeholder = torch.zeros(self._batch_sizes[False]) if self.holds_last_stage else None
        self._loss.evaluating = True
        try:
            with torch.no_grad():
                if self.holds_first_stage:
                    return schedule.eval(*args, target=placeholder, **kwargs)
                return schedule.eval(target=placeholder)
        finally:
            self._loss.evaluating = False


def pad_batch(values: Any, size: int, fixed: int) -> Any:
    """Every batch tensor of ``size`` samples in ``values`` padded to ``fixed`` with copies of its last sample."""
    from torch.utils._pytree import tree_map

    def pad(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != size:
            return value
        return torch.cat([value, value[-1:].expand(fixed - size, *value.shape[1:])])

    return tree_map(pad, values)


def _cut_batch(values: Any, fixed: int, size: int) -> Any:
    from torch.utils._pytree import tree_map

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == fixed:
            return value[:size]
        return value

    return tree_map(cut, values)


def broadcast_outputs(outputs: Any, group: dist.ProcessGroup, src: int, device: torch.device) -> Any:
    """``outputs`` (tensors in any nested structure) of group rank ``src``, on every rank of ``group``: the
    structure, shapes and dtypes as one object, then each tensor by ``broadcast``."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    is_source = dist.get_rank(group) == src
    leaves, spec = tree_flatten(outputs) if is_source else ([], None)
    described = [(t.shape, t.dtype) if isinstance(t, torch.Tensor) else t for t in leaves]
    meta = [(_dump_spec(spec) if is_source else None, described)]
    dist.broadcast_object_list(meta, group=group, group_src=src)
    dumped, described = meta[0]
    received = []
    for index, item in enumerate(described):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.dtype)):
            received.append(item)  # a non-tensor leaf came with the structure
            continue
        shape, dtype = item
        tensor = (
            leaves[index].detach().contiguous()
            if is_source
            else torch.empty(shape, dtype=dtype, device=device)
        )
        dist.broadcast(tensor, group=group, group_src=src)
        received.append(tensor)
    return tree_unflatten(received, _load_spec(dumped))


def _dump_spec(spec: Any) -> tuple[str, Any]:
    """The structure as JSON where torch can write it (pickling a ``TreeSpec`` warns in torch 2.13)."""
    from torch.utils._pytree import treespec_dumps

    try:
        return ("json", treespec_dumps(spec))
    except Exception:  # a node type registered without serialization: send the object itself
        return ("object", spec)


def _load_spec(dumped: tuple[str, Any]) -> Any:
    from torch.utils._pytree import treespec_loads

    kind, value = dumped
    return treespec_loads(value) if kind == "json" else value


def _mark_loaded(model: nn.Module, incompatible: Any) -> None:
    """After ``load_state_dict`` (of a checkpoint, a weights file, ...): the keys it filled hold values."""
    assert isinstance(model, PipelinedModel)
    if model._uninitialised:
        filled = set(model.state_dict()) - set(incompatible.missing_keys)
        model._uninitialised -= filled


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
