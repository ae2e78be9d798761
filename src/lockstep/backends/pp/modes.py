"""Train/eval mode for traced pipeline stages, and buffers kept through torch's shape pass.

torch's tracer (``torch.export`` under ``torch.distributed.pipelining.pipeline``) records the operators a
module ran, with the train/eval mode of that moment as a constant argument: a ``Dropout`` traced in training
mode becomes ``aten.dropout(x, p, True)``, a ``BatchNorm`` ``aten.batch_norm(..., training=True, ...)`` plus
``num_batches_tracked.add_(1)``. Left so, ``model.eval()`` would change nothing. So the model is traced in
training mode (:func:`traced_in_training`: the recorded graph then holds every mode-dependent operator and
its probabilities), and :func:`follow_module_modes` makes those operators read the ``training`` flag of the
stage module that owns them at run time: the arguments named ``train``/``training`` of any operator take
the flag, ``dropout_p`` becomes 0 and ``use_input_stats`` (instance norm) False in eval mode, and the
``num_batches_tracked`` increment runs in training mode only; a norm keeping no running statistics
(``track_running_stats=False``: no ``running_mean`` argument) uses the batch's statistics in both modes,
as PyTorch's does. :func:`copy_modes` then gives
each stage module the mode of the user's module of the same name (a BatchNorm the user froze with
``.eval()`` stays frozen).

What this cannot see: Python code branching on ``self.training`` (a module returning something else in
training) is traced in its training branch only. Random numbers drawn outside dropout are the likeliest
case (noise added in training only), so :func:`training_only_suspects` lists them and ``prepare`` warns.

:class:`BufferKeepingStage` is torch's ``PipelineStage`` whose shape pass leaves the buffers alone. In
torch 2.13 the stage infers the shapes of what it exchanges by running a real forward (the first stage on
the first micro-batch, the others on uninitialised tensors of the received shapes) at the first step and
again at each switch between a step with backward and one without (training and evaluation). A BatchNorm
in training mode would count that forward in its running statistics (garbage on later stages); the stage
saves every buffer of its module before the pass and copies it back after. torch already forks the random
generator around the pass, so dropout masks are drawn as without it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.pipelining import PipelineStage
from torch.export.unflatten import InterpreterModule

_FLAG_ARGUMENTS = ("train", "training")


@contextmanager
def traced_in_training(model: nn.Module) -> Iterator[None]:
    """``model`` in training mode inside the block; every module's own mode restored after."""
    modes = [(module, module.training) for module in model.modules()]
    model.train()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def copy_modes(model: nn.Module, stage_modules: Sequence[nn.Module]) -> None:
    """Give each module of the stages the mode of ``model``'s module of the same name (the stage roots:
    the model's own mode)."""
    modules = dict(model.named_modules())
    for stage in stage_modules:
        for name, module in stage.named_modules():
            source = modules.get(name)
            module.training = source.training if source is not None else model.training


class _ModeAware:
    """An operator of a traced graph whose mode-dependent arguments follow ``owner.training`` at each call."""

    def __init__(
        self, op: torch._ops.OpOverload, owner: nn.Module, *, only_in_training: bool = False
    ) -> None:
        self.op = op
        self.owner = owner
        self.only_in_training = only_in_training
        self.__name__ = f"mode_aware_{op.__name__.replace('.', '_')}"
        self._positions = {argument.name: index for index, argument in enumerate(op._schema.arguments)}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        training = self.owner.training
        if self.only_in_training:
            return self.op(*args, **kwargs) if training else args[0]
        args = list(args)
        if (
            not training
            and "running_mean" in self._positions
            and self._get(args, kwargs, "running_mean") is None
        ):
            return self.op(
                *args, **kwargs
            )  # a norm keeping no running statistics uses the batch's in both modes
        for name in _FLAG_ARGUMENTS:
            self._set(args, kwargs, name, training)
        if not training:
            self._set(args, kwargs, "dropout_p", 0.0)
            self._set(args, kwargs, "use_input_stats", False)
        return self.op(*args, **kwargs)

    def _get(self, args: list[Any], kwargs: dict[str, Any], name: str) -> Any:
        index = self._positions.get(name)
        if index is None:
            return None
        return args[index] if index < len(args) else kwargs.get(name)

    def _set(self, args: list[Any], kwargs: dict[str, Any], name: str, value: Any) -> None:
        index = self._positions.get(name)
        if index is None:
            return
        if index < len(args):
            args[index] = value
        else:
            kwargs[name] = value

    def __repr__(self) -> str:
        return f"{self.__name__}(owner={type(self.owner).__name__})"


def _mode_dependent(op: torch._ops.OpOverload) -> bool:
    names = {argument.name for argument in op._schema.arguments}
    return bool(names & {*_FLAG_ARGUMENTS, "dropout_p", "use_input_stats"})


def _counts_batches(node: fx.Node) -> bool:
    """BatchNorm's ``num_batches_tracked.add_(1)``, recorded only when traced in training mode."""
    target = node.args[0] if node.args else None
    return (
        node.target is torch.ops.aten.add_.Tensor
        and isinstance(target, fx.Node)
        and target.op == "get_attr"
        and str(target.target).split(".")[-1] == "num_batches_tracked"
    )


def follow_module_modes(stage_modules: Sequence[nn.Module]) -> list[str]:
    """Rewrite the traced graphs of ``stage_modules`` so their mode-dependent operators follow the owning
    module's ``training`` flag (see the module docs). Returns ``"module: operator"`` for each one rewritten."""
    rewritten = []
    for name, owner, graph in _traced_modules(stage_modules):
        changed = False
        for node in _aten_calls(graph):
            if _counts_batches(node):
                node.target = _ModeAware(node.target, owner, only_in_training=True)
            elif _mode_dependent(node.target):
                node.target = _ModeAware(node.target, owner)
            else:
                continue
            changed = True
            rewritten.append(f"{name}: {node.target.op}")
        if changed:
            _recompile(owner)
    return rewritten


def training_only_suspects(stage_modules: Sequence[nn.Module]) -> list[str]:
    """``"module: operator"`` for each operator of the stages that draws random numbers outside dropout
    (``torch.randn_like``, ``bernoulli``, ...): traced in training mode, it runs in eval mode too, which is
    wrong when the model draws it only ``if self.training`` (see the module docs)."""
    found = []
    for name, _, graph in _traced_modules(stage_modules):
        for node in _aten_calls(graph):
            op = node.target
            if torch.Tag.nondeterministic_seeded in op.tags and not _mode_dependent(op):
                found.append(f"{name}: {op}")
    return found


def _traced_modules(stage_modules: Sequence[nn.Module]) -> Iterator[tuple[str, nn.Module, fx.Graph]]:
    """Each module of the stages that holds a traced graph: its name in its stage, the module, the graph."""
    for stage in stage_modules:
        for name, owner in stage.named_modules():
            graph = getattr(owner, "graph", None)
            if isinstance(graph, fx.Graph):
                yield name, owner, graph


def _aten_calls(graph: fx.Graph) -> Iterator[fx.Node]:
    """The nodes of ``graph`` that call an ATen operator (an ``OpOverload``)."""
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            yield node


def _recompile(owner: nn.Module) -> None:
    if isinstance(owner, InterpreterModule):
        owner.finalize()  # both of its ways to run (interpreter, generated code) read the new graph
    else:
        assert isinstance(owner, fx.GraphModule), type(owner)
        owner.recompile()


class BufferKeepingStage(PipelineStage):
    """torch's ``PipelineStage`` whose shape pass leaves its module's buffers as they were: they are saved
    before the forward of the pass and copied back once the pass is over (after its backward, which checks
    that the tensors its forward saved were not changed since)."""

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        if not hasattr(self, "_buffers_before_shape_pass"):
            self._buffers_before_shape_pass = [(b, b.detach().clone()) for b in self.submod.buffers()]
        return super()._forward_metadata_inference(*args, **kwargs)

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        saved = self.__dict__.pop("_buffers_before_shape_pass", [])
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
