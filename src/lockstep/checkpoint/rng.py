"""Every random number generator of a rank, saved in the file Accelerate writes and reads.

``random_states_<rank>.pkl`` holds the dict Accelerate's ``save_state`` writes (``step``,
``random_state``, ``numpy_random_seed``, ``torch_manual_seed``, and ``torch_cuda_manual_seed`` when CUDA
is in use), so either library resumes from the other's checkpoint. NumPy's state is a tuple holding a
``uint32`` array: it loads with ``torch.load(weights_only=True)`` once NumPy's array reconstruction is
allowed (:func:`lockstep.checkpoint.safe_load.safe_torch_load` with ``numpy=True``, as Accelerate does);
nothing else is unpickled. Checkpoints of earlier lockstep versions (``random_states_<rank>.pt``, NumPy
state as tensors) are still read.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

RNG_FILE = "random_states_{rank}.pkl"
"""Accelerate's name, written and read by lockstep."""
LEGACY_RNG_FILE = "random_states_{rank}.pt"
"""What lockstep wrote before (read only)."""


def capture_rng_state(step: int) -> dict[str, Any]:
    """This rank's Python, NumPy, torch CPU and (when in use) CUDA generator states, and the accumulation
    step, in Accelerate's layout."""
    state: dict[str, Any] = {
        "step": int(step),
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> int | None:
    """Set every generator from a state in Accelerate's layout (or lockstep's earlier one); returns the
    saved accumulation step, if the file has one."""
    if "python" in state:
        _restore_legacy(state)
        return None
    random.setstate(_python_state(state["random_state"]))
    np.random.set_state(state["numpy_random_seed"])
    torch.set_rng_state(state["torch_manual_seed"])
    cuda = state.get("torch_cuda_manual_seed")
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    return int(state["step"]) if "step" in state else None


def derive_rng_state(state: dict[str, Any], rank: int) -> None:
    """Seed every generator of a rank the checkpoint has no file for (it was saved on fewer processes)
    from a saved rank's ``state``: deterministic for the same checkpoint and rank, and distinct from the
    saved streams (the seed is a hash of the saved torch state and ``rank``)."""
    torch_state = state["torch"] if "python" in state else state["torch_manual_seed"]
    digest = hashlib.sha256(torch_state.numpy().tobytes() + rank.to_bytes(8, "little")).digest()
    seed = int.from_bytes(digest[:8], "little")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # every device's generator too


def _python_state(value: Any) -> tuple:
    version, internal, gauss = value
    return version, tuple(int(x) for x in internal), gauss


def rng_file(folder: Path, rank: int) -> Path | None:
    """This rank's RNG file in ``folder`` (Accelerate's name first), or None when there is none."""
    for name in (RNG_FILE, LEGACY_RNG_FILE):
        path = folder / name.format(rank=rank)
        if path.is_file():
            return path
    return None


def _restore_legacy(state: dict[str, Any]) -> None:
    python = state["python"]
    random.setstate((python["version"], tuple(int(x) for x in python["state"].tolist()), python["gauss"]))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["kind"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["position"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
