"""``cpu_ram_efficient_loading``: the main process holds the pretrained weights, the others receive shards.

Every process moves its model to the meta device before sharding (tied weights stay tied), shards it,
allocates only its own shards, and then torch's ``set_model_state_dict(broadcast_from_rank0=True)``
sends each process its part of the main process's weights. Buffers that are not in the state dict
(non-persistent ones, such as position ids) are broadcast separately.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging

import torch
import torch.distributed as dist
from torch import nn

from lockstep import _env
from lockstep.state import PartialState

_logger = logging.getLogger(__name__)


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _importable(module: str) -> bool:
    """Whether ``module`` can be found (not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails to import, or a broken __spec__
        return False


_TRANSFORMERS_LOADS_WITHOUT_ACCELERATE = (4, 51)
"""transformers 4.51 removed ``low_cpu_mem_usage`` (``from_pretrained`` pops it), the path on which it asked for
accelerate when only the main process reads the weights (measured: 4.50.3 refuses without accelerate, 4.56.2
loads)."""


def why_transformers_cannot_load_on_main_only() -> str | None:
    """Why the installed transformers cannot read pretrained weights on the main process only (None: it can,
    or transformers is not installed and nothing reads the announcement).

    transformers before 4.51 takes that path (``low_cpu_mem_usage``) only where its own
    ``is_accelerate_available()`` says yes, an installed distribution of accelerate at its minimum version or
    later, and otherwise fails in ``from_pretrained`` on every process. transformers itself is asked: an
    ``accelerate`` module that imports (an import shim, a source folder on the path) is not enough for it.
    From 4.51 on (``low_cpu_mem_usage`` gone), and in transformers 5, it needs nothing more.
    """
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None
    from packaging.version import Version

    if Version(version).release[:2] >= _TRANSFORMERS_LOADS_WITHOUT_ACCELERATE:
        return None
    from transformers.utils import import_utils

    if import_utils.is_accelerate_available():
        return None
    minimum = getattr(import_utils, "ACCELERATE_MIN_VERSION", None)
    needed = f"accelerate>={minimum}" if minimum else "accelerate"
    found = _version("accelerate")
    if found is not None:
        what = f"accelerate {found} is installed"
    elif _importable("accelerate"):
        what = "an accelerate module imports here, but no accelerate distribution is installed (no version)"
    else:
        what = "accelerate is not installed"
    return (
        f"transformers {version} reads the weights on the main process only through {needed}, and its "
        f"is_accelerate_available() says no: {what}"
    )


def announce_main_process_loading() -> bool:
    """Tell transformers' ``from_pretrained`` that only the main process needs the pretrained weights, where the
    installed transformers can honour it; returns whether it was told. Elsewhere every process reads them
    (more memory while loading, the same training: :func:`broadcast_from_main` sends the main process's
    weights at ``prepare`` either way)."""
    reason = why_transformers_cannot_load_on_main_only()
    if reason is None:
        _env.announce_rank0_loading()
        return True
    _logger.info(
        "cpu_ram_efficient_loading: %s, so every process reads the pretrained weights in from_pretrained; "
        "prepare() still gives every process the main process's weights. Install transformers>=4.51 (or the "
        "accelerate distribution transformers names) for loading on the main process only.",
        reason,
    )
    return False


def to_meta(model: nn.Module) -> None:
    """Move ``model`` to the meta device in place, keeping shared (tied) parameters shared."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to("meta")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def broadcast_from_main(
    model: nn.Module,
    full_state: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    state: PartialState,
) -> None:
    """Fill the sharded, freshly allocated ``model`` with the main process's weights and buffers."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=state.use_distributed)
    set_model_state_dict(model, full_state, options=options)
    names = [None]
    if state.is_main_process:
        names = [sorted(buffers)]
    if state.use_distributed:
        dist.broadcast_object_list(names, src=0)
    own = dict(model.named_buffers())
    for name in names[0] or []:
        target = own[name]
        if state.is_main_process:
            target.copy_(buffers[name].to(target.device))
        if state.use_distributed:
            comm = target if target.device.type == "cpu" or dist.get_backend() != "gloo" else target.cpu()
            dist.broadcast(comm, src=0)
            if comm is not target:
                target.copy_(comm)
