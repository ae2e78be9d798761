"""Loading checkpoint files without ever unpickling arbitrary objects.

Everything lockstep writes besides safetensors loads with ``torch.load(weights_only=True)``: tensors,
numbers, strings, and lists/tuples/dicts of them. :func:`check_loadable` refuses, at save time, state
that could not be loaded back that way, so a checkpoint never needs an unsafe load.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lockstep.checkpoint import single_pass
from lockstep.errors import UnsafeCheckpointError

_SAFE_LEAVES = (torch.Tensor, int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def _numpy_array_globals() -> list[Any]:
    """What unpickling a plain NumPy array needs (the globals Accelerate allows for its RNG files)."""
    import codecs

    import numpy as np

    core = np._core if hasattr(np, "_core") else np.core  # NumPy 2 renamed np.core
    allowed: list[Any] = [core.multiarray._reconstruct, np.ndarray, np.dtype, codecs.encode]
    allowed += [getattr(np.dtypes, name) for name in ("UInt32DType", "Int64DType") if hasattr(np, "dtypes")]
    return allowed


def safe_torch_load(
    path: Path | str, *, map_location: str | torch.device = "cpu", numpy: bool = False
) -> Any:
    """``torch.load(path, weights_only=True)``, with a clear error for files that need more.

    Args:
        path: the file.
        map_location: where tensors go.
        numpy: also allow plain NumPy arrays (as in Accelerate's ``random_states_<rank>.pkl``). Arrays of
            Python objects still need globals that stay refused.

    Raises:
        UnsafeCheckpointError: the file carries arbitrary pickled objects (its payload is not run).
        FileNotFoundError: the file does not exist.
    """
    try:
        with (
            warnings.catch_warnings(),
            torch.serialization.safe_globals(_numpy_array_globals() if numpy else []),
            single_pass.reading(path),
        ):
            # A raw pickle (not torch's zip format) makes torch warn about the protocol before refusing it.
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            if str(map_location) == "cpu" and single_pass.expects(path):
                return single_pass.load_torch_file(Path(path))
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UnsafeCheckpointError(
            f"{path} holds Python objects that cannot be loaded safely, so it was refused without running "
            f"them ({first_line}). lockstep checkpoints contain only tensors, numbers and strings; this file "
            "was not written by lockstep or was tampered with."
        ) from None


def check_loadable(value: Any, where: str) -> None:
    """Raise a ValueError naming the first part of ``value`` that ``weights_only`` loading would refuse."""
    if isinstance(value, _SAFE_LEAVES):
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, (str, int, float, bool, type(None))):
                raise ValueError(
                    f"{where} has a key of type {type(key).__name__}, which cannot be saved safely."
                )
            check_loadable(item, f"{where}[{key!r}]")
        return
    if isinstance(value, (list, tuple, set)):
        for index, item in enumerate(value):
            check_loadable(item, f"{where}[{index}]")
        return
    raise ValueError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which lockstep cannot store in a "
        "checkpoint that loads safely (only tensors, numbers, strings, None and lists/tuples/dicts of them). "
        "Make state_dict() return plain values."
    )


def safe_torch_save(value: Any, path: Path, *, where: str) -> None:
    """``torch.save`` after checking that the value will load with ``weights_only=True``."""
    check_loadable(value, where)
    torch.save(value, path)
