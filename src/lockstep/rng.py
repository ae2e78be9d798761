"""Seeding and synchronising random number generators across processes."""

from __future__ import annotations

import random as _py_random
from collections.abc import Iterable

import numpy as np
import torch
import torch.distributed as dist

from lockstep.config.enums import RNGType


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python, NumPy and torch (CPU and every accelerator).

    Args:
        seed: the seed.
        device_specific: add the process index, so that each rank draws different numbers.
        deterministic: also ask torch for deterministic algorithms.

    Example:
        >>> set_seed(42)
    """
    if device_specific:
        from lockstep.state import PartialState

        seed += PartialState().process_index
    _py_random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)  # seeds CUDA/MPS/XPU generators too
    if deterministic:
        torch.use_deterministic_algorithms(True)


def _rng_state(rng_type: RNGType, generator: torch.Generator | None) -> torch.Tensor | None:
    if rng_type == RNGType.TORCH:
        return torch.get_rng_state()
    if rng_type == RNGType.CUDA and torch.cuda.is_available():
        return torch.cuda.get_rng_state()
    if rng_type == RNGType.GENERATOR and generator is not None:
        return generator.get_state()
    return None


def _set_rng_state(rng_type: RNGType, state: torch.Tensor, generator: torch.Generator | None) -> None:
    if rng_type == RNGType.TORCH:
        torch.set_rng_state(state)
    elif rng_type == RNGType.CUDA:
        torch.cuda.set_rng_state(state)
    elif rng_type == RNGType.GENERATOR and generator is not None:
        generator.set_state(state)


def synchronize_rng_state(rng_type: RNGType | str, generator: torch.Generator | None = None) -> None:
    """Copy rank 0's state of one generator to every rank (no-op for one process)."""
    rng_type = RNGType.parse(rng_type, argument="rng_types")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    state = _rng_state(rng_type, generator)
    if state is None:
        return
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    buffer = state.to(device)
    dist.broadcast(buffer, src=0)
    _set_rng_state(rng_type, buffer.cpu(), generator)


def synchronize_rng_states(
    rng_types: Iterable[RNGType | str], generator: torch.Generator | None = None
) -> None:
    """Copy rank 0's state of each listed generator to every rank."""
    for rng_type in rng_types:
        synchronize_rng_state(rng_type, generator)
