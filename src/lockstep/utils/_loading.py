"""Loading weight files into a model tensor by tensor (:mod:`lockstep.utils.modeling`'s loaders).

A safetensors checkpoint is read one tensor at a time (a sharded one through its index), each tensor going
to its device or, for a block mapped to ``"disk"``, to a memory-mapped file in the offload folder; so a
model never needs two copies in memory, nor its offloaded part at all. ``.bin`` files are read whole, one
file at a time, with ``torch.load(weights_only=True)`` only.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from lockstep.checkpoint.model_files import SAFE_WEIGHTS_NAME, WEIGHTS_NAME
from lockstep.checkpoint.safe_load import safe_torch_load
from lockstep.state import PartialState
from lockstep.utils._model_tensors import (
    as_dtype,
    check_tied_parameters_on_same_device,
    device_for,
    find_tied_parameters,
    retie_parameters,
    set_module_tensor_to_device,
    torch_device,
)
from lockstep.utils.offload import offload_weight, save_offload_index

__all__ = ["load_checkpoint_in_model", "load_state_dict"]

_DISK = "disk"


def _check_safetensors_format(path: str, metadata: Mapping[str, str] | None) -> None:
    form = (metadata or {}).get("format", "pt")
    if form not in ("pt", "tf", "flax"):
        raise OSError(
            f"{path} has metadata format {form!r}, which is not a safetensors model format ('pt', 'tf' or "
            "'flax'). Save the model with save_model or save_pretrained."
        )
    if form != "pt":
        raise ValueError(f"{path} holds {form} weights; lockstep loads PyTorch ('pt') weights only.")


def load_state_dict(
    checkpoint_file: str | os.PathLike[str], device_map: Mapping[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """Read one weight file (``.safetensors``, or ``.bin`` with ``weights_only=True``) into a state dict.

    Args:
        checkpoint_file: the file.
        device_map: module or tensor name -> device; a safetensors tensor is read straight onto the device
            of its longest mapped prefix (the CPU when unmapped or mapped to ``"disk"``).

    Raises:
        OSError, ValueError: the safetensors metadata names another framework.
        UnsafeCheckpointError: a ``.bin`` file holds arbitrary Python objects (they are not run).

    Example:
        >>> state = load_state_dict("out/model.safetensors", device_map={"": 0})  # doctest: +SKIP
    """
    path = os.fspath(checkpoint_file)
    if not path.endswith(".safetensors"):
        state = safe_torch_load(path, map_location="cpu")
        if not isinstance(state, dict):
            raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict.")
        return state
    with safe_open(path, framework="pt") as handle:
        _check_safetensors_format(path, handle.metadata())
        names = list(handle.keys())
    placement: dict[str, list[str]] = {}
    for name in names:
        device = device_for(name, device_map, default="cpu") if device_map else "cpu"
        placement.setdefault("cpu" if device == _DISK else str(torch_device(device)), []).append(name)
    state: dict[str, torch.Tensor] = {}
    for device, keys in placement.items():
        with safe_open(path, framework="pt", device=device) as handle:
            state.update({key: handle.get_tensor(key) for key in keys})
    return {name: state[name] for name in names}


def _checkpoint_files(checkpoint: str | os.PathLike[str]) -> tuple[list[Path], set[str] | None]:
    """The weight files to read and, for an index, every key it promises."""
    path = Path(checkpoint)
    index: Path | None = None
    if path.is_file():
        if path.name.endswith(".json"):
            index = path
        else:
            return [path], None
    elif path.is_dir():
        for name in (SAFE_WEIGHTS_NAME, WEIGHTS_NAME):
            if (path / name).is_file():
                return [path / name], None
        indexes = sorted(path.glob("*.index.json"))
        if len(indexes) != 1:
            found = ", ".join(p.name for p in indexes) or "none"
            raise ValueError(
                f"load_checkpoint_in_model({str(path)!r}): the folder needs {SAFE_WEIGHTS_NAME}, {WEIGHTS_NAME} "
                f"or exactly one *.index.json (found {found}). Pass the file to load instead."
            )
        index = indexes[0]
    else:
        raise ValueError(
            f"load_checkpoint_in_model({str(path)!r}): no such file or folder. Pass a weight file, an index "
            "(*.index.json), or a folder holding them."
        )
    data = json.loads(index.read_text(encoding="utf-8"))
    weight_map = data.get("weight_map", data)
    files = sorted(set(weight_map.values()))
    return [index.parent / name for name in files], set(weight_map)


def _tie_groups(tied: Iterable[list[str]]) -> dict[str, list[str]]:
    return {name: group for group in tied for name in group}


def _check_unsupported(
    device_map: Mapping[str, Any] | None,
    offload_8bit_bnb: bool,
    offload_folder: str | os.PathLike[str] | None,
) -> None:
    if offload_8bit_bnb:
        raise NotImplementedError(
            "load_checkpoint_in_model(offload_8bit_bnb=True) offloads bitsandbytes 8-bit layers, which lockstep "
            "does not support: lockstep does not integrate bitsandbytes. Pass offload_8bit_bnb=False."
        )
    disk = [name for name, device in (device_map or {}).items() if str(device) == _DISK]
    if disk and offload_folder is None:
        raise ValueError(
            f"load_checkpoint_in_model(): the device_map sends {disk[:5]} to 'disk', and no offload_folder was "
            "given. Pass offload_folder= (a folder for the offloaded weights)."
        )


def _value_dtype(
    name: str, value: torch.Tensor, dtype: torch.dtype | None, keep_in_fp32: list[str]
) -> torch.dtype | None:
    """The dtype ``name`` is loaded in: ``dtype`` for floating-point values, fp32 for kept modules."""
    if dtype is None or not torch.is_floating_point(value):
        return None
    if any(module in name.split(".") for module in keep_in_fp32):
        return torch.float32
    return dtype


def _has_dtensor(model: nn.Module) -> bool:
    if "torch.distributed.tensor" not in sys.modules:
        return False  # nothing made a DTensor, and importing the module costs ~40 MB and a second
    from torch.distributed.tensor import DTensor

    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


def _load_through_dcp(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    *,
    strict: bool,
    full_state_dict: bool,
    broadcast_from_rank0: bool,
) -> None:
    """Sharded (DTensor) models, or broadcasting: torch's ``set_model_state_dict``.

    With ``broadcast_from_rank0`` only the main process reads the checkpoint; the others receive it.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state: dict[str, torch.Tensor] = {}
    if not broadcast_from_rank0 or PartialState().is_main_process:
        for file in _checkpoint_files(checkpoint)[0]:
            state.update(load_state_dict(file))
    options = StateDictOptions(
        full_state_dict=full_state_dict, broadcast_from_rank0=broadcast_from_rank0, strict=strict
    )
    set_model_state_dict(model, state, options=options)


def _is_pipelined(model: nn.Module) -> bool:
    """A model that holds part of itself on this rank (a pipeline's stages) loads by stage."""
    return bool(getattr(model, "holds_part_of_the_model", False))


def _read_keys(file: Path, wanted: set[str]) -> dict[str, torch.Tensor]:
    """The tensors of ``file`` named in ``wanted``: a safetensors file reads those alone (the others are not
    read from disk), a ``.bin`` file is read whole and filtered."""
    if not file.name.endswith(".safetensors"):
        return {key: value for key, value in load_state_dict(file).items() if key in wanted}
    with safe_open(str(file), framework="pt") as handle:
        _check_safetensors_format(str(file), handle.metadata())
        return {key: handle.get_tensor(key) for key in handle.keys() if key in wanted}


def _file_keys(file: Path) -> set[str]:
    if not file.name.endswith(".safetensors"):
        return set(load_state_dict(file))
    with safe_open(str(file), framework="pt") as handle:
        return set(handle.keys())


def _load_stage_weights(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    *,
    strict: bool,
    device_map: Mapping[str, Any] | None,
    broadcast: bool,
) -> None:
    """A pipelined model (``ParallelismConfig(pp_size > 1)``): each rank reads only the tensors of its own
    stages and copies them into them in place (the other stages' tensors, and index shards holding none
    of this rank's, are not read)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    where = f"load_checkpoint_in_model({os.fspath(checkpoint)!r})"
    if device_map is not None or broadcast:
        raise ValueError(
            f"{where} got device_map={device_map!r}, broadcast_from_rank0={broadcast!r} for a pipelined model: "
            "each pipeline rank reads its own stages' tensors onto its device. Pass neither."
        )
    wanted = set(model.state_dict())
    state: dict[str, torch.Tensor] = {}
    found: set[str] = set()
    for file in _checkpoint_files(checkpoint)[0]:
        keys = _file_keys(file)
        found |= keys
        if keys & wanted:
            state.update(_read_keys(file, wanted))
    missing = sorted(wanted - found)
    unexpected = sorted(found - set(model.key_order))  # keys of no stage, on no rank
    if missing or unexpected:
        report = _Keys(model.key_order, {}, where).report(missing, unexpected)
        if strict:
            raise ValueError(f"{report} Load the checkpoint of this architecture, or pass strict=False.")
        warnings.warn(report, UserWarning, stacklevel=3)
    local = model.state_dict()
    for key, value in state.items():
        if isinstance(local[key], DTensor):  # a stage sharded over dp_shard: this rank's shard of the tensor
            state[key] = distribute_tensor(
                value, local[key].device_mesh, local[key].placements, src_data_rank=None
            )
    # missing keys are left as they were (and, if never filled, the model refuses to train: see .meta_init)
    model.load_state_dict(state, strict=False)


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: Mapping[str, Any] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: list[str] | None = None,
    offload_8bit_bnb: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> None:
    """Load a (possibly sharded) checkpoint into ``model`` tensor by tensor (safetensors files are read one
    tensor at a time; a ``.bin`` file whole).

    Each tensor goes to its ``device_map`` device; without a map it stays on the device it is on, and a
    tensor on the meta device (from ``init_empty_weights``) is created on the CPU. Tied parameters are
    tied again afterwards.

    Args:
        model: the model to fill.
        checkpoint: a weight file, an index (``*.index.json``), or a folder holding ``model.safetensors``,
            ``pytorch_model.bin`` (safetensors is preferred when both exist) or one index with its shards.
        device_map: module name -> device (``""`` for the whole model). Weights mapped to ``"disk"`` are
            written to ``offload_folder`` (one memory-mapped file each, with an ``index.json``) and left on
            the meta device in the model; :func:`lockstep.dispatch_model` reads them from there.
        offload_folder: the folder for the weights mapped to ``"disk"`` (needed when some are).
        dtype: load floating-point tensors in this dtype.
        offload_state_dict: accepted and ignored (a memory saving for disk offload), with a warning.
        offload_buffers: write the buffers of disk blocks to the folder too (otherwise they load on the CPU).
        keep_in_fp32_modules: module names whose floating-point tensors stay fp32 whatever ``dtype``.
        offload_8bit_bnb: bitsandbytes offload; not supported.
        strict: raise when the checkpoint and the model do not have the same keys (otherwise warn).
        full_state_dict: for models with DTensor (FSDP2) parameters: the files hold whole tensors.
        broadcast_from_rank0: only the main process reads the files and sends each process its part (needs
            a process group; every process must call this).

    A pipelined model (prepared with ``ParallelismConfig(pp_size > 1)``, e.g. built on the meta device)
    is filled stage by stage: each rank reads only its stages' tensors (from a safetensors file, those
    tensors alone) and copies them into the prepared stages in place; ``device_map`` and
    ``broadcast_from_rank0`` do not apply.

    Raises:
        ValueError: the checkpoint cannot be found, ``"disk"`` is mapped without ``offload_folder``, or with
            ``strict`` the keys differ (known before any tensor is read for safetensors and indexed
            checkpoints).
        NotImplementedError: ``offload_8bit_bnb``.

    Example:
        >>> with init_empty_weights():  # doctest: +SKIP
        ...     model = MyModel(config)
        >>> load_checkpoint_in_model(model, "out/model", device_map={"": 0})  # doctest: +SKIP
    """
    _check_unsupported(device_map, offload_8bit_bnb, offload_folder)
    if offload_state_dict:
        warnings.warn(
            "load_checkpoint_in_model(offload_state_dict=True) is ignored: lockstep reads the checkpoint one "
            "tensor at a time, so there is no whole state dict to offload.",
            UserWarning,
            stacklevel=2,
        )
    if _is_pipelined(model):
        _load_stage_weights(
            model, checkpoint, strict=strict, device_map=device_map, broadcast=broadcast_from_rank0
        )
        return
    if broadcast_from_rank0 or _has_dtensor(model):
        _load_through_dcp(
            model,
            checkpoint,
            strict=strict,
            full_state_dict=full_state_dict,
            broadcast_from_rank0=broadcast_from_rank0,
        )
        return
    placement = _Placement(
        device_map,
        as_dtype(dtype) if dtype is not None else None,
        keep_in_fp32_modules or [],
        offload_folder=offload_folder,
        offload_buffers=offload_buffers,
        buffers={name for name, _ in model.named_buffers()},
    )
    _load_tensor_by_tensor(model, checkpoint, placement, strict=strict)


def _load_tensor_by_tensor(
    model: nn.Module, checkpoint: str | os.PathLike[str], placement: _Placement, *, strict: bool
) -> None:
    """The plain path: every tensor of every file placed as ``placement`` says, then ties restored."""
    files, promised = _checkpoint_files(checkpoint)
    tied = find_tied_parameters(model)
    if placement.device_map is not None:
        check_tied_parameters_on_same_device(tied, placement.device_map)
    keys = _Keys(
        list(model.state_dict()), _tie_groups(tied), f"load_checkpoint_in_model({os.fspath(checkpoint)!r})"
    )
    if strict and promised is not None:
        keys.check(promised)  # an index lists every key: a mismatch is known before any tensor is read
    if strict and promised is None and all(file.name.endswith(".safetensors") for file in files):
        keys.check(set().union(*(_file_keys(file) for file in files)))  # the headers, before any tensor
    loaded: set[str] = set()
    for file in files:
        for state in _tensor_batches(file):
            if strict and promised is None and not file.name.endswith(".safetensors"):
                keys.check(state)
            loaded.update(placement.place(model, state, mapped=file.name.endswith(".safetensors")))
    retie_parameters(model, tied)
    placement.finish(tied)
    missing, unexpected = keys.differences(loaded)
    if missing or unexpected:
        warnings.warn(keys.report(missing, unexpected), UserWarning, stacklevel=3)


def _tensor_batches(file: Path) -> Iterator[dict[str, torch.Tensor]]:
    """The tensors of ``file``: one at a time from a safetensors file, at once from a ``.bin`` file.

    safetensors (>= 0.6) returns tensors backed by a map of the whole file, and every page read stays
    resident while any of them lives: a 5 GB shard whose CPU tensors are kept would keep the pages of its
    disk-offloaded tensors too. So each tensor comes from a map opened for it alone, gone once the tensor
    is written to the offload folder or copied into the model (:meth:`_Placement.place`).
    """
    if not file.name.endswith(".safetensors"):
        yield load_state_dict(file)
        return
    with safe_open(str(file), framework="pt") as handle:
        _check_safetensors_format(str(file), handle.metadata())
        names = list(handle.keys())
    for name in names:
        with safe_open(str(file), framework="pt") as handle:
            tensor = handle.get_tensor(name)
        yield {name: tensor}


@dataclass
class _Keys:
    """The model's state-dict keys, compared with a checkpoint's (a tied alias counts when its group does)."""

    model: list[str]
    groups: dict[str, list[str]]
    where: str

    def differences(self, found: Iterable[str]) -> tuple[list[str], list[str]]:
        found = set(found)
        known = set(self.model)
        missing = [
            k for k in self.model if k not in found and not any(n in found for n in self.groups.get(k, []))
        ]
        return missing, sorted(found - known)

    def report(self, missing: list[str], unexpected: list[str]) -> str:
        return (
            f"{self.where}: the checkpoint and the model differ. Missing from the checkpoint ({len(missing)}): "
            f"{missing[:10]}. Unknown to the model ({len(unexpected)}): {unexpected[:10]}."
        )

    def check(self, found: Iterable[str]) -> None:
        missing, unexpected = self.differences(found)
        if missing or unexpected:
            raise ValueError(
                f"{self.report(missing, unexpected)} Load the checkpoint of this architecture, or pass strict=False."
            )


@dataclass
class _Placement:
    """Where and in which dtype each loaded tensor goes; ``"disk"`` tensors are written to the offload folder."""

    device_map: Mapping[str, Any] | None
    dtype: torch.dtype | None
    keep_in_fp32: list[str]
    offload_folder: str | os.PathLike[str] | None = None
    offload_buffers: bool = False
    buffers: set[str] = field(default_factory=set)
    offload_index: dict[str, Any] = field(default_factory=dict)
    _model_keys: dict[str, torch.Tensor] | None = None

    def place(
        self, model: nn.Module, state: Mapping[str, torch.Tensor], *, mapped: bool = False
    ) -> list[str]:
        """Put the tensors of ``state`` the model has into it; returns every key of ``state``.

        ``mapped``: the tensors are pages of a safetensors file map, copied when they stay on the CPU.
        """
        if self._model_keys is None:  # read once: only the names and the meta-or-not device are used
            self._model_keys = model.state_dict(keep_vars=True)
            if self.offload_folder is not None:
                os.makedirs(self.offload_folder, exist_ok=True)
        for name, value in state.items():
            current = self._model_keys.get(name)
            if current is None:
                continue
            if self.device_map is not None:
                device = device_for(name, self.device_map, default="cpu")
            else:
                device = "cpu" if current.device.type == "meta" else current.device
            value_dtype = _value_dtype(name, value, self.dtype, self.keep_in_fp32)
            if str(device) == _DISK and (self.offload_buffers or name not in self.buffers):
                value = value if value_dtype is None else value.to(value_dtype)
                offload_weight(value, name, self.offload_folder, index=self.offload_index)  # type: ignore[arg-type]
                continue
            device = "cpu" if str(device) == _DISK else device  # a disk block's buffers stay in memory
            if mapped and str(device) == "cpu" and value.device.type == "cpu":
                value = value.clone()  # kept: its own memory, not a page of a file map (see _tensor_batches)
            set_module_tensor_to_device(
                model, name, device, value=value, dtype=value_dtype, clear_cache=False
            )
        return list(state)

    def finish(self, tied: Iterable[list[str]]) -> None:
        """Give every name of a tied group the offloaded file of the one the checkpoint held (a checkpoint
        saves a tied weight once), and write the offload index."""
        if self.offload_folder is None:
            return
        folder = Path(self.offload_folder)
        for group in tied:
            stored = next((name for name in group if name in self.offload_index), None)
            if stored is None:
                continue
            for name in group:
                on_disk = (
                    self.device_map is not None and str(device_for(name, self.device_map, "cpu")) == _DISK
                )
                if name not in self.offload_index and on_disk:
                    _link_or_copy(folder / f"{stored}.dat", folder / f"{name}.dat")
                    self.offload_index[name] = self.offload_index[stored]
        save_offload_index(self.offload_index, folder)


def _link_or_copy(source: Path, target: Path) -> None:
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)  # no second copy on disk
    except OSError:
        shutil.copyfile(source, target)
