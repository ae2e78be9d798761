"""A model built on the meta device, materialised stage by stage: no pipeline rank ever holds the whole model.

The user builds the model without memory (``with lockstep.init_empty_weights():`` or ``with
torch.device("meta"):``) and prepares it. ``prepare`` traces it on the meta device (shapes only), keeps this
rank's stages, and gives only their meta tensors storage on the device (:func:`materialise`, torch's
``to_empty``: the values are garbage). The names of those tensors are *uninitialised* until something fills
them: ``lockstep.utils.load_checkpoint_in_model`` (each rank reads its stages' tensors only),
``accelerator.load_state``, any ``load_state_dict`` of the prepared model, or
:meth:`~lockstep.backends.pp.model.PipelinedModel.init_weights` (:func:`init_stage_weights`). A training or
evaluation step with uninitialised tensors left on any rank is refused (:func:`uninitialised_report`).

Example:
    >>> import torch
    >>> from torch import nn
    >>> with torch.device("meta"):
    ...     layer = nn.Linear(2, 2)
    >>> materialise([layer], torch.device("cpu"))
    ['weight', 'bias']
    >>> layer.weight.device
    device(type='cpu')
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


def has_meta_tensors(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device (it was built without memory)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


@contextmanager
def meta_stand_ins(model: nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """Trace a model built on the meta device with its real tensors (e.g. the buffers
    ``init_empty_weights`` keeps) swapped for meta stand-ins: the tracer runs on meta inputs, and a real
    tensor among them would be a device mismatch. Yields ``id(stand-in) -> real tensor`` for
    :func:`put_back`; the model holds its own tensors again after the block."""
    stand_ins: dict[int, torch.Tensor] = {}
    by_real: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for name, tensor in tensors.items():
                if tensor is None or tensor.is_meta:
                    continue
                if id(tensor) not in by_real:
                    by_real[id(tensor)] = _meta_like(tensor)
                    stand_ins[id(by_real[id(tensor)])] = tensor
                swapped.append((tensors, name, tensor))
                tensors[name] = by_real[id(tensor)]
    try:
        yield stand_ins
    finally:
        for tensors, name, tensor in swapped:
            tensors[name] = tensor


def put_back(modules: Sequence[nn.Module], stand_ins: dict[int, torch.Tensor]) -> None:
    """Replace the stand-ins of :func:`meta_stand_ins` in ``modules`` (the traced stages) by the real tensors."""
    for module in modules:
        for owner in module.modules():
            for tensors in (owner._parameters, owner._buffers):
                for name, tensor in tensors.items():
                    if tensor is not None and id(tensor) in stand_ins:
                        tensors[name] = stand_ins[id(tensor)]


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    meta = tensor.detach().to("meta")
    return (
        nn.Parameter(meta, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    )


def materialise(modules: Sequence[nn.Module], device: torch.device) -> list[str]:
    """Give every meta parameter and buffer of ``modules`` uninitialised storage on ``device``, in place of
    the meta tensor (a new ``Parameter``, shared where the meta one was shared, with its attributes); real
    tensors are left alone. Returns the names of the materialised tensors."""
    replaced: dict[int, torch.Tensor] = {}
    names: list[str] = []
    for module in modules:
        for prefix, owner in module.named_modules(remove_duplicate=False):
            for kind in ("_parameters", "_buffers"):
                tensors = getattr(owner, kind)
                for name, tensor in tensors.items():
                    if tensor is None or not tensor.is_meta:
                        continue
                    if id(tensor) not in replaced:
                        replaced[id(tensor)] = _empty_like(tensor, device)
                        names.append(f"{prefix}.{name}" if prefix else name)
                    tensors[name] = replaced[id(tensor)]
    return names


def _empty_like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    empty = torch.empty_like(tensor, device=device)
    if not isinstance(tensor, nn.Parameter):
        return empty
    parameter = nn.Parameter(empty, requires_grad=tensor.requires_grad)
    parameter.__dict__.update(tensor.__dict__)  # e.g. a no-weight-decay mark set in the model's __init__
    return parameter


def init_stage_weights(
    stages: Sequence[tuple[int, nn.Module]],
    source: Mapping[str, nn.Module],
    fn: Callable[[nn.Module], None] | None,
    seed: int,
) -> set[str]:
    """Initialise the tensors of ``stages`` (``(stage index, stage module)`` pairs) in place, each stage
    under the random seed ``seed + stage index``.

    The traced stages keep no module classes (their submodules are torch's ``InterpreterModule``), so the
    user's own modules (``source``: the meta model's modules by name) are run instead, holding this stage's
    tensors for the call: ``fn(module)``, or without ``fn`` its ``reset_parameters()``, for every module
    that directly owns a tensor of the stage, in the model's order. Returns the names of the tensors of the
    modules that were run (those without ``reset_parameters`` are not, without ``fn``)."""
    done: set[str] = set()
    for index, stage in stages:
        tensors = {**dict(stage.named_parameters()), **dict(stage.named_buffers())}
        with _forked_rng(stage), torch.no_grad():
            torch.manual_seed(seed + index)
            for prefix, module in source.items():
                owned = (*module._parameters, *module._buffers)
                held = {
                    name: key for name in owned if (key := f"{prefix}.{name}" if prefix else name) in tensors
                }
                if not held or (fn is None and not callable(getattr(module, "reset_parameters", None))):
                    continue
                with _holding(module, {name: tensors[key] for name, key in held.items()}):
                    fn(module) if fn is not None else module.reset_parameters()
                done |= set(held.values())
    return done


@contextmanager
def _holding(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """``module`` holds ``tensors`` (by attribute name) in place of its own for the block, and what the block
    writes lands in them. A tensor sharded over ``dp_shard`` (a DTensor) is held whole (gathered), so the
    module initialises the whole tensor under the stage's seed, as without sharding, and this rank's shard
    is copied back. A tensor the block replaces instead of filling in place is copied in too."""
    held = {name: _whole(tensor) for name, tensor in tensors.items()}
    saved = {}
    for name, value in held.items():
        slot = _slot(module, name)
        saved[name], slot[name] = slot[name], value
    try:
        yield
    finally:
        for name, tensor in tensors.items():
            slot = _slot(module, name)
            value = held[name] if slot[name] is None else slot[name]
            if value is not tensor:
                _copy_into(tensor, value)
            slot[name] = saved[name]


def _slot(module: nn.Module, name: str) -> dict[str, Any]:
    return module._parameters if name in module._parameters else module._buffers


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, DTensor):
        return tensor
    whole = tensor.full_tensor()  # a collective over the stage's dp_shard ranks, which all run this
    return (
        nn.Parameter(whole, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else whole
    )


def _copy_into(tensor: torch.Tensor, value: torch.Tensor) -> None:
    if isinstance(tensor, DTensor):
        value = distribute_tensor(value.detach(), tensor.device_mesh, tensor.placements, src_data_rank=None)
    tensor.copy_(value)


def _forked_rng(module: nn.Module) -> AbstractContextManager[None]:
    """Restore the random generators the initialisation of ``module`` draws from (the CPU's and its
    accelerator's) afterwards, so the seed does not change the user's random stream."""
    devices = {t.device for t in module.parameters() if t.device.type != "cpu"}
    if not devices:
        return torch.random.fork_rng(devices=[])
    kind = next(iter(devices)).type
    return torch.random.fork_rng(devices=[d.index or 0 for d in devices], device_type=kind)


def uninitialised_report(pending_by_rank: Sequence[Sequence[str]], what: str) -> str | None:
    """The error message for a step while tensors are uninitialised on some ranks (None when none is)."""
    parts = [
        f"rank {rank}: {', '.join(names[:6])}{f', ... ({len(names)} in all)' if len(names) > 6 else ''}"
        for rank, names in enumerate(pending_by_rank)
        if names
    ]
    if not parts:
        return None
    return (
        f"{what}: the model was built on the meta device, and these tensors of the pipeline stages hold no "
        f"values yet ({'; '.join(parts)}). After prepare() and before the first step, fill them on every rank: "
        "lockstep.utils.load_checkpoint_in_model(model, 'model.safetensors') (each rank reads its stages' "
        "tensors only), accelerator.load_state(folder), or model.init_weights() (each module's "
        "reset_parameters(), seeded per stage) / model.init_weights(fn). Buffers that are not saved "
        "(persistent=False) are in no weight file: build the model under lockstep.init_empty_weights(), which "
        "keeps buffers real, or set them with model.init_weights(fn)."
    )
