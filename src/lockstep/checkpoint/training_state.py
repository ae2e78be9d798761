"""What a checkpoint holds, file by file, and how it is written and read back.

Layout of a checkpoint folder (Accelerate's names where they exist):

```
model.safetensors            model 0 (model_1/, model_2/... hold further models)
optimizer.bin, optimizer_1.bin, ...   optimizer state dicts
scheduler.bin, ...           LR scheduler state dicts
scaler.pt                    the fp16 GradScaler
dataloader.bin, ...          each prepared dataloader's position (epoch, batches consumed, sampler seed)
custom_checkpoint_0.pkl, ... objects registered with register_for_checkpointing
random_states_{rank}.pkl     every RNG of every rank and the accumulation step (Accelerate's dict)
grads_{rank}.safetensors     gradients accumulated so far, when saved in the middle of an accumulation cycle
accelerator_state.json       the accumulation position and other counters
frozen_base.json             the keys saved and a fingerprint of the frozen base left out (peft models only)
manifest.json                written last (see lockstep.checkpoint.layout)
```

Everything but safetensors and JSON is written with ``torch.save`` and read with ``weights_only=True``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from lockstep.checkpoint import hashed_write, single_pass
from lockstep.checkpoint.model_files import holds_model_files, save_model_files
from lockstep.checkpoint.rng import RNG_FILE, capture_rng_state, derive_rng_state, restore_rng_state, rng_file
from lockstep.checkpoint.safe_load import check_loadable, safe_torch_load

ACCELERATOR_STATE = "accelerator_state.json"
CUSTOM_FILE = "custom_checkpoint_{index}.pkl"
"""Accelerate's name for a registered object's state (lockstep wrote ``.bin`` before; both are read)."""


def indexed(name: str, index: int, suffix: str) -> str:
    """``optimizer.bin``, ``optimizer_1.bin``, ... (Accelerate's naming)."""
    return f"{name}{'' if index == 0 else f'_{index}'}{suffix}"


def model_folder(root: Path, index: int) -> Path:
    return root if index == 0 else root / f"model_{index}"


def accelerate_fsdp_model_file(index: int) -> str:
    """The file Accelerate's FSDP ``FULL_STATE_DICT`` save writes model ``index`` to (``pytorch_model_fsdp.bin``,
    ``pytorch_model_fsdp_1.bin``, ...)."""
    return indexed("pytorch_model_fsdp", index, ".bin")


def find_model_weights(root: Path, index: int) -> Path | None:
    """Where model ``index``'s whole weights are, or None: lockstep's folder (the checkpoint itself for model
    0, ``model_{index}/`` for the others), the single file Accelerate writes for a further model
    (``model_1.safetensors`` / ``pytorch_model_1.bin``), or Accelerate's FSDP full state dict
    (``pytorch_model_fsdp.bin``)."""
    folder = model_folder(root, index)
    if holds_model_files(folder):
        return folder
    names = [] if index == 0 else [f"model_{index}.safetensors", f"pytorch_model_{index}.bin"]
    for name in (*names, accelerate_fsdp_model_file(index)):
        if (root / name).is_file():
            return root / name
    return None


def model_location(root: Path, index: int) -> Path:
    """Where model ``index``'s weights are (:func:`find_model_weights`); lockstep's folder when there are
    none, so that loading names what it looked for."""
    return find_model_weights(root, index) or model_folder(root, index)


@dataclass
class TrainingObjects:
    """Everything a checkpoint's shared files hold, as the Accelerator and its backend hand it over."""

    schedulers: list[Any] = field(default_factory=list)
    dataloaders: list[Any] = field(default_factory=list)
    scaler: torch.amp.GradScaler | None = None
    custom: list[Any] = field(default_factory=list)
    """Objects registered with ``register_for_checkpointing``."""
    counters: dict[str, Any] = field(default_factory=dict)
    model_states: Sequence[dict[str, torch.Tensor] | None] = ()
    """Weights written as model files, one per prepared model (None: the backend writes that model itself)."""
    optimizer_states: Sequence[Any] = ()
    """One per prepared optimizer: an object whose ``state_dict()`` is written as its optimizer file (the
    optimizer itself, or a :class:`GivenState`), or None when the backend writes it. ``state_dict()`` is
    called by the processes that write shared files only, inside the save's error agreement."""
    gradients: Callable[[], dict[str, torch.Tensor]] = dict
    records: dict[str, Any] = field(default_factory=dict)
    """Further JSON files by name (what a save left out and why, e.g. ``frozen_base.json``)."""
    """This rank's pending gradients (``"<model index>.<parameter>"``), taken inside the save's error
    agreement and written to its own file."""


@dataclass
class Snapshot:
    """Everything one rank will write, copied out of the live training objects.

    Taking it is the only part of a save that must stop training; writing it can happen in the
    background (see :mod:`lockstep.checkpoint.async_writer`).
    """

    models: list[tuple[Path, dict[str, torch.Tensor]]] = field(default_factory=list)
    torch_files: list[tuple[str, Any]] = field(default_factory=list)
    safetensors_files: list[tuple[str, dict[str, torch.Tensor]]] = field(default_factory=list)
    json_files: list[tuple[str, Any]] = field(default_factory=list)
    safe_serialization: bool = True

    def nbytes(self) -> int:
        tensors = [t for _, sd in self.models + self.safetensors_files for t in sd.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def tensor_bytes(self) -> int:
        """The bytes of every tensor its files hold, optimizer states too: about what writing it needs on
        disk (the files add their headers)."""
        return self.nbytes() + sum(_tensor_bytes(value) for _, value in self.torch_files)


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _detached(value: Any, copy: bool) -> Any:
    """A CPU copy of every tensor in ``value`` (a real copy when ``copy``; training may change them)."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        return tensor.to("cpu", copy=True) if copy else tensor.cpu()
    if isinstance(value, dict):
        return {k: _detached(v, copy) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v, copy) for v in value)
    return value


def snapshot_shared(
    objects: TrainingObjects, *, safe_serialization: bool = True, copy: bool = False
) -> Snapshot:
    """The files written once (by the main process): weights, optimizers, schedulers, loaders, objects."""
    snap = Snapshot(safe_serialization=safe_serialization)
    for index, state_dict in enumerate(objects.model_states):
        if state_dict is not None:
            snap.models.append((Path("." if index == 0 else f"model_{index}"), _detached(state_dict, copy)))
    entries: list[tuple[str, Any, str]] = [
        (indexed("optimizer", i, ".bin"), owner, f"optimizer {i}")
        for i, owner in enumerate(objects.optimizer_states)
        if owner is not None
    ]
    entries += [
        (indexed("scheduler", i, ".bin"), s, f"scheduler {i}") for i, s in enumerate(objects.schedulers)
    ]
    if objects.scaler is not None:
        entries.append(("scaler.pt", objects.scaler, "the GradScaler"))
    loaders = [dl for dl in objects.dataloaders if hasattr(dl, "state_dict")]
    entries += [(indexed("dataloader", i, ".bin"), dl, f"dataloader {i}") for i, dl in enumerate(loaders)]
    entries += [
        (CUSTOM_FILE.format(index=i), obj, f"registered object {i}.state_dict()")
        for i, obj in enumerate(objects.custom)
    ]
    for name, owner, where in entries:
        state = owner.state_dict()
        check_loadable(state, where)
        snap.torch_files.append((name, _detached(state, copy)))
    snap.json_files.append((ACCELERATOR_STATE, dict(objects.counters)))
    snap.json_files += list(objects.records.items())
    return snap


def snapshot_rank(objects: TrainingObjects, *, rank: int) -> Snapshot:
    """The files every rank writes: its RNG states and its not-yet-synchronised gradients."""
    snap = Snapshot()
    step = int(objects.counters.get("step", 0))
    snap.torch_files.append((RNG_FILE.format(rank=rank), capture_rng_state(step)))
    gradients = objects.gradients()
    if gradients:
        snap.safetensors_files.append((f"grads_{rank}.safetensors", gradients))
    return snap


@dataclass
class GivenState:
    """A state dict computed beforehand (e.g. gathered from shards), in the place of an object whose
    ``state_dict()`` would not give the whole state."""

    state: Any

    def state_dict(self) -> Any:
        return self.state


PARALLEL_WRITE_BYTES = 64 * 1024 * 1024
"""A snapshot with at least this many tensor bytes writes its files on several threads (smaller ones in
order: a thread costs more than it saves there)."""
WRITER_THREADS = 4


def write_snapshot(snap: Snapshot, folder: Path) -> dict[str, dict[str, Any]]:
    """Write a snapshot's files into ``folder`` (a checkpoint's staging folder), handing the bytes to the OS:
    the checkpoint's commit makes every file durable (now or in the background), the weights included.
    Returns each file's manifest entry by its name in ``folder``, its checksum computed from the bytes as
    they were written (:mod:`lockstep.checkpoint.hashed_write`), never read back from the disk.

    The files are independent, so a large snapshot writes them on up to :data:`WRITER_THREADS` threads
    (the writers release the GIL while the bytes are hashed and written: the weights and the optimizer state
    of a 302 MB checkpoint took 165 ms together against 188 ms one after the other). Every write finishes
    before an error is raised, so nothing writes into a staging folder that is being removed."""
    writes = _file_writes(snap, folder)
    if len(writes) < 2 or snap.tensor_bytes() < PARALLEL_WRITE_BYTES:
        results = [write() for write in writes]
    else:
        with ThreadPoolExecutor(min(WRITER_THREADS, len(writes)), thread_name_prefix="lockstep-save") as pool:
            futures = [pool.submit(write) for write in writes]
        results = [future.result() for future in futures]  # the first failure, raised once every write ended
    return {
        path.relative_to(folder).as_posix(): facts for written in results for path, facts in written.items()
    }


def _file_writes(snap: Snapshot, folder: Path) -> list[Callable[[], dict[Path, dict[str, Any]]]]:
    """One call per file (or weight folder) of ``snap``, largest first; each returns the manifest entries of
    what it wrote, by path."""
    sized: list[tuple[int, Callable[[], dict[Path, dict[str, Any]]]]] = []
    for subfolder, state_dict in snap.models:
        sized.append(
            (
                sum(_tensor_bytes(t) for t in state_dict.values()),
                lambda sd=state_dict, sub=subfolder: _model_files(sd, folder / sub, snap.safe_serialization),
            )
        )
    for name, value in snap.torch_files:
        path = folder / name
        sized.append((_tensor_bytes(value), lambda v=value, p=path: {p: hashed_write.write_torch(v, p)}))
    for name, tensors in snap.safetensors_files:
        size = sum(_tensor_bytes(t) for t in tensors.values())
        path = folder / name
        sized.append((size, lambda t=tensors, p=path: {p: hashed_write.write_safetensors(_contiguous(t), p)}))
    for name, value in snap.json_files:
        path = folder / name
        sized.append((0, lambda v=value, p=path: {p: hashed_write.write_text(p, json.dumps(v, indent=1))}))
    return [write for _, write in sorted(sized, key=lambda entry: -entry[0])]


def _model_files(state_dict: dict[str, torch.Tensor], folder: Path, safe: bool) -> dict[Path, dict[str, Any]]:
    written: dict[Path, dict[str, Any]] = {}
    save_model_files(state_dict, folder, safe_serialization=safe, fsync=False, written=written)
    return written


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors as ``safetensors.torch.save_file`` takes them: contiguous (a copy only where they are not)."""
    return {name: tensor.contiguous() for name, tensor in tensors.items()}


def load_shared_files(objects: TrainingObjects, folder: Path, *, positions: bool = True) -> dict[str, Any]:
    """Restore schedulers, scaler, loaders and registered objects; returns the counters.

    Models and optimizers are the backend's (:meth:`lockstep.backends.base.Backend.read_model_states`).

    Args:
        objects: what to restore.
        folder: the checkpoint.
        positions: restore the prepared loaders' positions; False for a checkpoint that has none (one
            written by Accelerate): the loaders then start their epoch from its beginning.
    """
    load_each(list(enumerate(objects.schedulers)), folder, "scheduler", ".bin")
    if objects.scaler is not None and (folder / "scaler.pt").is_file():
        objects.scaler.load_state_dict(safe_torch_load(folder / "scaler.pt"))
    if positions:
        loaders = [dl for dl in objects.dataloaders if hasattr(dl, "load_state_dict")]
        load_each(list(enumerate(loaders)), folder, "dataloader", ".bin")
    for index, obj in enumerate(objects.custom):
        obj.load_state_dict(_custom_state(folder, index, obj))
    counters_path = folder / ACCELERATOR_STATE
    if not counters_path.is_file():
        return {}
    with single_pass.reading(counters_path):
        return json.loads(counters_path.read_text())


def _custom_state(folder: Path, index: int, obj: Any) -> Any:
    for path in (folder / CUSTOM_FILE.format(index=index), folder / f"custom_checkpoint_{index}.bin"):
        if path.is_file():
            return safe_torch_load(path, numpy=True)
    raise FileNotFoundError(
        f"{folder} holds no state for registered object {index} ({type(obj).__name__}): register the same "
        "objects, in the same order, as when the checkpoint was saved."
    )


def load_each(targets: Sequence[tuple[int, Any]], folder: Path, name: str, suffix: str) -> None:
    """``target.load_state_dict`` from ``name_<index><suffix>`` for each ``(index, target)``."""
    for index, target in targets:
        path = folder / indexed(name, index, suffix)
        if not path.is_file():
            raise FileNotFoundError(
                f"{folder} has no {path.name}: the checkpoint holds fewer {name}s than were prepared now "
                f"({len(targets)}). Prepare the same objects as when it was saved."
            )
        target.load_state_dict(safe_torch_load(path))


@dataclass
class RankFiles:
    """What a checkpoint held for this rank."""

    gradients: dict[str, torch.Tensor] | None
    """Pending gradients (None: the checkpoint has no files for this rank, e.g. fewer processes saved it)."""
    step: int | None = None
    """The accumulation step saved with the RNG states (checkpoints written by Accelerate carry it there)."""


def load_rank_files(folder: Path, *, rank: int) -> RankFiles:
    """Restore this rank's RNG states; returns its saved pending gradients and step.

    A rank the checkpoint has no files for (it was saved on fewer processes) gets random streams derived
    from saved rank ``rank % saved`` (:func:`~lockstep.checkpoint.rng.derive_rng_state`).
    """
    path = rng_file(folder, rank)
    if path is None:
        saved = _saved_rng_files(folder)
        if not saved:
            return RankFiles(gradients=None)
        state = safe_torch_load(saved[rank % len(saved)], numpy=True)
        derive_rng_state(state, rank)
        return RankFiles(gradients=None, step=int(state["step"]) if "step" in state else None)
    step = restore_rng_state(safe_torch_load(path, numpy=True))
    gradients_path = folder / f"grads_{rank}.safetensors"
    if not gradients_path.is_file():
        return RankFiles(gradients={}, step=step)
    with single_pass.reading(gradients_path):
        return RankFiles(gradients=load_file(str(gradients_path)), step=step)


def _saved_rng_files(folder: Path) -> list[Path]:
    """The RNG files in ``folder``, by rank (ranks 0, 1, ... up to the first one without a file)."""
    files: list[Path] = []
    while (path := rng_file(folder, len(files))) is not None:
        files.append(path)
    return files
