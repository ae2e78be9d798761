"""``accelerate.utils.offload``: weights kept on disk as raw NumPy memory maps, with a JSON index.

A folder of offloaded weights holds one ``<name>.dat`` file per tensor (its raw bytes; bf16 is stored as
int16, which NumPy lacks) and ``index.json`` mapping each name to ``{"dtype", "shape"}``: Accelerate's disk
offload layout, so folders written by either library read in the other. ``lockstep.disk_offload``,
``lockstep.dispatch_model`` and ``lockstep.load_checkpoint_and_dispatch`` write such folders and read each
block's weights back memory-mapped as it runs; :class:`OffloadedWeightsLoader` reads them as a mapping, e.g.
to fill a model with
``lockstep.utils.load_offloaded_weights`` or ``load_state_dict``.

Example:
    >>> import torch
    >>> offload_state_dict("offload", {"w": torch.arange(4.0).reshape(2, 2), "b": torch.zeros(2)})
    >>> weights = OffloadedWeightsLoader(save_folder="offload")
    >>> sorted(weights), weights["w"]
    (['b', 'w'], tensor([[0., 1.],
            [2., 3.]]))
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "OffloadedWeightsLoader",
    "PrefixedDataset",
    "extract_submodules_state_dict",
    "load_offloaded_weight",
    "offload_state_dict",
    "offload_weight",
    "save_offload_index",
]

PathLike = str | os.PathLike[str]
INDEX_FILE = "index.json"
_BF16 = "bfloat16"  # NumPy has no bfloat16: its bits are stored as int16 under this dtype name


def offload_weight(
    weight: torch.Tensor, weight_name: str, offload_folder: PathLike, index: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """Write ``weight`` to ``<offload_folder>/<weight_name>.dat`` and, given an ``index``, record it there.

    Args:
        weight: the tensor (any device; it is copied to the CPU).
        weight_name: its name, used for the file (``"encoder.weight"`` -> ``encoder.weight.dat``).
        offload_folder: an existing folder.
        index: the index to add ``{"dtype", "shape"}`` to (written later by :func:`save_offload_index`).

    Returns:
        ``index``, updated.

    Example:
        >>> import os
        >>> os.makedirs("folder", exist_ok=True)
        >>> offload_weight(torch.ones(2, dtype=torch.bfloat16), "scale", "folder", index={})
        {'scale': {'dtype': 'bfloat16', 'shape': [2]}}
    """
    dtype = None
    if weight.dtype == torch.bfloat16:
        weight = weight.view(torch.int16)
        dtype = _BF16
    array = weight.detach().cpu().numpy()
    if index is not None:
        index[weight_name] = {"dtype": dtype or str(array.dtype), "shape": list(array.shape)}
    if array.ndim == 0:  # a memory map has at least one dimension
        array = array[None]
    stored = np.memmap(
        Path(offload_folder) / f"{weight_name}.dat", dtype=array.dtype, mode="w+", shape=array.shape
    )
    stored[:] = array[:]
    stored.flush()
    return index


def load_offloaded_weight(weight_file: PathLike, weight_info: Mapping[str, Any]) -> torch.Tensor:
    """Read one tensor written by :func:`offload_weight`: a CPU tensor of the recorded dtype and shape,
    memory-mapped from the file (its pages are read when used, and released when the tensor is freed).

    Args:
        weight_file: its ``.dat`` file.
        weight_info: its index entry, ``{"dtype": ..., "shape": [...]}``.

    Example:
        >>> index = offload_weight(torch.tensor(2.5), "step", ".", index={})
        >>> load_offloaded_weight("step.dat", index["step"])
        tensor(2.5000)
    """
    shape = tuple(weight_info["shape"])
    stored_dtype = "int16" if weight_info["dtype"] == _BF16 else weight_info["dtype"]
    # copy-on-write map: the tensor reads the file's pages (nothing is copied, and they are unmapped when
    # the tensor is freed), and writing to it never changes the file
    array = np.memmap(weight_file, dtype=stored_dtype, shape=shape or (1,), mode="c")
    weight = torch.tensor(array[0]) if not shape else torch.from_numpy(array)
    return weight.view(torch.bfloat16) if weight_info["dtype"] == _BF16 else weight


def save_offload_index(index: Mapping[str, Any] | None, offload_folder: PathLike) -> None:
    """Merge ``index`` into ``<offload_folder>/index.json`` (created if missing; nothing to do when empty)."""
    if not index:
        return
    path = Path(offload_folder) / INDEX_FILE
    current = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    current.update(index)
    path.write_text(json.dumps(current, indent=2), encoding="utf-8")


def offload_state_dict(save_dir: PathLike, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Write every tensor of ``state_dict`` into ``save_dir`` (created if missing), with its ``index.json``."""
    os.makedirs(save_dir, exist_ok=True)
    index: dict[str, Any] = {}
    for name, tensor in state_dict.items():
        offload_weight(tensor, name, save_dir, index=index)
    save_offload_index(index, save_dir)


class PrefixedDataset(Mapping):
    """A view of ``dataset`` under a prefix: ``view[key]`` is ``dataset[prefix + key]``.

    Iterating yields the underlying keys that start with the prefix (prefix included), and ``len`` is the
    whole dataset's, as in Accelerate.

    Example:
        >>> view = PrefixedDataset({"layer.weight": 1, "layer.bias": 2, "head.weight": 3}, "layer.")
        >>> view["weight"], list(view)
        (1, ['layer.weight', 'layer.bias'])
    """

    def __init__(self, dataset: Mapping[str, Any], prefix: str) -> None:
        self.dataset = dataset
        self.prefix = prefix

    def __getitem__(self, key: str) -> Any:
        return self.dataset[f"{self.prefix}{key}"]

    def __iter__(self) -> Iterator[str]:
        return iter([key for key in self.dataset if key.startswith(self.prefix)])

    def __len__(self) -> int:
        return len(self.dataset)


class OffloadedWeightsLoader(Mapping):
    """A mapping from weight names to tensors held in memory (``state_dict``) or on disk (an offload index).

    In-memory tensors win over the index. An index entry is either ``{"dtype", "shape"}`` (a ``.dat`` file in
    ``save_folder``) or ``{"safetensors_file", "weight_name", "dtype"}`` (a tensor inside a safetensors file,
    read lazily on ``device``).

    Args:
        state_dict: tensors already in memory.
        save_folder: the folder of ``.dat`` files; its ``index.json`` is read when ``index`` is not given.
        index: the index to use.
        device: where safetensors entries are loaded (the CPU when None).

    Raises:
        ValueError: none of ``state_dict``, ``save_folder`` and ``index`` is given.
    """

    def __init__(
        self,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        save_folder: PathLike | None = None,
        index: Mapping[str, Any] | None = None,
        device: int | str | torch.device | None = None,
    ) -> None:
        if state_dict is None and save_folder is None and index is None:
            raise ValueError(
                "OffloadedWeightsLoader() needs weights: pass state_dict=, save_folder= (a folder written by "
                "offload_state_dict) or index=."
            )
        self.state_dict = {} if state_dict is None else state_dict
        self.save_folder = save_folder
        if index is None and save_folder is not None:
            index = json.loads((Path(save_folder) / INDEX_FILE).read_text(encoding="utf-8"))
        self.index = {} if index is None else index
        self.all_keys = list(self.state_dict)
        self.all_keys.extend(key for key in self.index if key not in self.state_dict)
        self.device = device

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.state_dict:
            return self.state_dict[key]
        info = self.index[key]
        if info.get("safetensors_file") is not None:
            return self._from_safetensors(key, info)
        if self.save_folder is None:
            raise KeyError(
                f"{key!r} is an offloaded weight, and OffloadedWeightsLoader has no save_folder to read it from."
            )
        return load_offloaded_weight(Path(self.save_folder) / f"{key}.dat", info)

    def _from_safetensors(self, key: str, info: Mapping[str, Any]) -> torch.Tensor:
        from safetensors import safe_open

        device = torch.device("cpu" if self.device is None else self.device)
        try:
            with safe_open(info["safetensors_file"], framework="pt", device=str(device)) as handle:
                tensor = handle.get_tensor(info.get("weight_name", key))
        except TypeError:  # a dtype the device cannot hold directly (bf16 on MPS): read on the CPU first
            with safe_open(info["safetensors_file"], framework="pt", device="cpu") as handle:
                tensor = handle.get_tensor(info.get("weight_name", key))
        if "dtype" in info:
            tensor = tensor.to(getattr(torch, info["dtype"]))
        return tensor.to(device)

    def __iter__(self) -> Iterator[str]:
        return iter(self.all_keys)

    def __len__(self) -> int:
        return len(self.all_keys)


def extract_submodules_state_dict(
    state_dict: Mapping[str, torch.Tensor], submodule_names: list[str]
) -> dict[str, torch.Tensor]:
    """The entries of ``state_dict`` that belong to the named submodules (``name`` itself or ``name.*``;
    ``h.1`` does not take ``h.10``'s).

    Example:
        >>> extract_submodules_state_dict({"h.1.w": 1, "h.10.w": 2, "head": 3}, ["h.1", "head"])
        {'h.1.w': 1, 'head': 3}
    """
    result: dict[str, torch.Tensor] = {}
    for module_name in submodule_names:
        result.update(
            (key, value)
            for key, value in state_dict.items()
            if key == module_name or key.startswith(module_name + ".")
        )
    return result
