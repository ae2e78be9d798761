"""A model's weights as (sharded) safetensors or ``.bin`` files, laid out like Hugging Face transformers.

One shard is written as ``model.safetensors``; more as ``model-00001-of-00003.safetensors`` ... next to
``model.safetensors.index.json``::

    {"metadata": {"total_size": <bytes of all stored tensors>},
     "weight_map": {"embed.weight": "model-00001-of-00003.safetensors", ...}}

With ``safe_serialization=False`` the names are ``pytorch_model.bin``, ``pytorch_model-0000k-of-0000n.bin``
and ``pytorch_model.bin.index.json``; they are read back with ``torch.load(weights_only=True)`` only.

Tied weights (several keys naming the same tensor, such as an embedding and the ``lm_head`` tied to it)
are stored once. In safetensors files the other names are recorded as aliases in the file metadata
(``{"lockstep_tied": "{\\"lm_head.weight\\": \\"embed.weight\\"}"}``) and, for sharded saves, in the index
metadata; every alias also appears in ``weight_map``, pointing at the file that holds its data. ``.bin``
files keep the alias next to its source, where ``torch.save`` stores the shared storage once. Loading
restores every key, the aliases again sharing one tensor.
"""

from __future__ import annotations

import json
import os
import re
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from lockstep.checkpoint import hashed_write, single_pass
from lockstep.checkpoint.safe_load import UnsafeCheckpointError, safe_torch_load

__all__ = [
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "UnsafeCheckpointError",
    "load_model_files",
    "load_model_weights",
    "parse_size",
    "save_model_files",
]

TIED_KEY = "lockstep_tied"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
_SIZE_HELP = (
    "Pass a positive number of bytes or a string such as '10GB', '500MB', '1.5GiB' or '2000KB' "
    "(units B, KB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB = powers of 1024)."
)


@dataclass(frozen=True)
class _Format:
    """The file names of one serialization: ``model.safetensors`` or ``pytorch_model.bin``."""

    prefix: str
    extension: str

    @property
    def single(self) -> str:
        return f"{self.prefix}.{self.extension}"

    @property
    def index(self) -> str:
        return f"{self.single}.index.json"

    def shard_names(self, count: int) -> list[str]:
        if count == 1:
            return [self.single]
        return [f"{self.prefix}-{i:05d}-of-{count:05d}.{self.extension}" for i in range(1, count + 1)]

    def owns(self, file_name: str) -> bool:
        """Whether ``file_name`` is a weight file or index this format writes."""
        escaped = re.escape(self.prefix), re.escape(self.extension)
        shard = re.fullmatch(r"{}(-\d+-of-\d+)?\.{}".format(*escaped), file_name)
        return shard is not None or file_name == self.index


_SAFETENSORS = _Format("model", "safetensors")
_PICKLE = _Format("pytorch_model", "bin")
_FORMATS = (_SAFETENSORS, _PICKLE)  # the order loading prefers them in

SAFE_WEIGHTS_NAME = _SAFETENSORS.single
SAFE_WEIGHTS_INDEX_NAME = _SAFETENSORS.index
WEIGHTS_NAME = _PICKLE.single
WEIGHTS_INDEX_NAME = _PICKLE.index


def parse_size(size: int | str) -> int:
    """Turn a size such as ``"10GB"`` into a number of bytes, the way transformers reads ``max_shard_size``.

    GB, MB, KB and TB are powers of 1000, GiB, MiB, KiB and TiB powers of 1024, and units are
    case-insensitive. As in transformers, a decimal unit ending in a lowercase ``b`` (``"5Gb"``, ``"500mb"``)
    counts bits, so it is divided by 8.

    Args:
        size: a positive number of bytes, or a number (may have a fraction) followed by a unit.

    Returns:
        The size in whole bytes.

    Raises:
        TypeError: ``size`` is neither an int nor a str.
        ValueError: the string cannot be read or the size is not positive.

    Example:
        >>> parse_size("1.5GiB"), parse_size("500MB"), parse_size(12345)
        (1610612736, 500000000, 12345)
    """
    return _parse_size(size, "parse_size")


def _parse_size(size: int | str, where: str) -> int:
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise TypeError(f"{where}({size!r}) is a {type(size).__name__}, not an int or a str. {_SIZE_HELP}")
    if isinstance(size, int):
        number = size
    else:
        match = _SIZE.match(size)
        unit = match.group(2) if match else ""
        if match is None or unit.upper() not in _UNITS:
            raise ValueError(f"{where}({size!r}) is not a size lockstep can read. {_SIZE_HELP}")
        try:
            number = int(Decimal(match.group(1)) * _UNITS[unit.upper()])
        except InvalidOperation as error:  # pragma: no cover - the regex admits only valid decimals
            raise ValueError(f"{where}({size!r}) is not a size lockstep can read. {_SIZE_HELP}") from error
        if len(unit) == 2 and unit[-1] == "b":  # transformers: "Gb" and "gb" are gigabits
            number //= 8
    if number < 1:
        raise ValueError(f"{where}({size!r}) is invalid: it must be at least 1 byte. {_SIZE_HELP}")
    return number


def save_model_files(
    state_dict: Mapping[str, torch.Tensor],
    save_directory: str | Path,
    *,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
    metadata: dict[str, str] | None = None,
    fsync: bool = True,
    written: dict[Path, dict[str, Any]] | None = None,
) -> list[Path]:
    """Write a state dict as weight files (and an index when there are several) into a folder.

    Tensors are taken in key order and packed into a shard until the next one would push it past
    ``max_shard_size``; a tensor larger than the limit gets a shard of its own. Tensors are made contiguous
    and copied to the CPU; tied tensors are stored once (see the module docstring). Each file is written to
    a temporary name in the same folder, fsynced and renamed into place; afterwards the weight files and
    index of any earlier save in the folder (either format) that this save did not overwrite are deleted.
    Every file is replaced atomically, the set of files is not: a crash midway can leave a mixed folder.

    Args:
        state_dict: parameter and buffer names mapped to tensors, e.g. ``model.state_dict()``.
        save_directory: the folder to write into; created if missing.
        max_shard_size: the largest shard, in bytes of tensor data, as accepted by :func:`parse_size`.
        safe_serialization: write safetensors files; ``False`` writes ``torch.save`` ``.bin`` files.
        metadata: extra string metadata for each safetensors file (``{"format": "pt"}`` is always set).
        fsync: make each file and the folder durable before returning. False hands the bytes to the OS only,
            for a caller that makes the folder durable itself (a checkpoint's commit fsyncs every file).
        written: when given, filled with each file's manifest entry (size and XXH3-128), by path, computed
            from the bytes as they were written (:mod:`lockstep.checkpoint.hashed_write`).

    Returns:
        The weight files written, then the index if one was written.

    Example:
        >>> save_model_files(model.state_dict(), "out/model", max_shard_size="2GB")  # doctest: +SKIP
        [PosixPath('out/model/model-00001-of-00002.safetensors'), ...]
    """
    max_bytes = _parse_size(max_shard_size, "save_model_files(max_shard_size=...)")
    file_metadata = _file_metadata(metadata, safe_serialization)
    stored, tied = _split_tied(state_dict)
    layout = _SAFETENSORS if safe_serialization else _PICKLE
    shards = _plan_shards(stored, max_bytes)
    directory = Path(save_directory)
    directory.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    weight_map: dict[str, str] = {}
    for file_name, keys in zip(layout.shard_names(len(shards)), shards):
        tensors = {key: stored[key] for key in keys}
        aliases = {alias: source for alias, source in tied.items() if source in tensors}
        path = directory / file_name
        if safe_serialization:
            meta = {**file_metadata, TIED_KEY: json.dumps(aliases)} if aliases else file_metadata
            write = _safetensors_writer(tensors, meta, hashed=written is not None)
        else:  # torch.save stores a storage once, so an alias next to its source costs nothing
            tensors.update({alias: tensors[source] for alias, source in aliases.items()})
            write = _torch_writer(tensors, hashed=written is not None)
        facts = _write_atomically(path, write, fsync=fsync)
        if written is not None:
            written[path] = facts
        weight_map.update(dict.fromkeys(tensors, file_name))
        weight_map.update(dict.fromkeys(aliases, file_name))
        files.append(path)
    if len(shards) > 1:
        total_size = sum(_nbytes(tensor) for tensor in stored.values())
        index: dict[str, Any] = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        if tied:
            index["metadata"][TIED_KEY] = tied
        files.append(directory / layout.index)
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        facts = _write_atomically(files[-1], lambda tmp: hashed_write.write_text(tmp, text), fsync=fsync)
        if written is not None:
            written[files[-1]] = facts
    _remove_stale(directory, keep={path.name for path in files})
    if fsync:
        _fsync_directory(directory)
    return files


def _file_metadata(metadata: dict[str, str] | None, safe_serialization: bool) -> dict[str, str]:
    """Validate the user's metadata and add ``{"format": "pt"}``."""
    if metadata is None:
        return {"format": "pt"}
    if not isinstance(metadata, Mapping) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in metadata.items()
    ):
        raise TypeError(
            f"save_model_files(metadata={metadata!r}) is invalid: safetensors metadata maps str to str. "
            "Encode other values, e.g. with json.dumps."
        )
    if TIED_KEY in metadata:
        raise ValueError(
            f"save_model_files(metadata=...) uses the key {TIED_KEY!r}, which lockstep reserves for tied "
            "weights. Rename that key."
        )
    if not safe_serialization and metadata:
        warnings.warn(
            "save_model_files(metadata=...) is ignored with safe_serialization=False: .bin files have no "
            "metadata. Use safetensors to keep it.",
            UserWarning,
            stacklevel=3,
        )
    return {"format": "pt", **metadata}


def _split_tied(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Split a state dict into standalone CPU tensors to store and ``{alias: source}`` for tied keys.

    Keys that view the very same memory (same address, dtype, shape and strides) are aliases of the first
    such key. Other overlapping views (a slice of a fused weight, a reshape) are copied: safetensors cannot
    store two tensors sharing memory, and ``torch.save`` would store the whole storage of a slice.
    """
    stored: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    first_key_of_view: dict[tuple[Any, ...], str] = {}
    used_storages: set[tuple[torch.device, int]] = set()
    for key, tensor in state_dict.items():
        if not isinstance(key, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"save_model_files(state_dict=...) maps {key!r} to a {type(tensor).__name__}; it must map "
                "str keys to torch.Tensor values. Pass model.state_dict()."
            )
        if tensor.device.type == "meta":
            raise ValueError(
                f"save_model_files(state_dict=...)[{key!r}] is on the meta device and has no data to save. "
                "Materialize the model's weights (e.g. load or initialize them) before saving."
            )
        tensor = tensor.detach()
        view = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if tensor.numel() > 0 and view in first_key_of_view:
            tied[key] = first_key_of_view[view]
            continue
        if tensor.numel() > 0:
            first_key_of_view[view] = key
        stored[key] = _standalone_cpu(tensor, used_storages)
    return stored, tied


def _standalone_cpu(tensor: torch.Tensor, used_storages: set[tuple[torch.device, int]]) -> torch.Tensor:
    """A contiguous CPU tensor that owns all of its storage and shares it with nothing stored before."""
    if tensor.numel() == 0:
        return torch.empty(tensor.shape, dtype=tensor.dtype)
    storage = (tensor.device, tensor.untyped_storage().data_ptr())
    shared = storage in used_storages
    used_storages.add(storage)
    if tensor.device.type != "cpu":
        return tensor.to("cpu").contiguous()  # the copy is new memory that fits the tensor exactly
    whole = tensor.is_contiguous() and tensor.untyped_storage().nbytes() == _nbytes(tensor)
    if shared or not whole:
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def _plan_shards(stored: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Group keys greedily, in order, into shards of at most ``max_bytes`` (one oversized tensor excepted)."""
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for key, tensor in stored.items():
        size = _nbytes(tensor)
        if shards[-1] and shard_bytes + size > max_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(key)
        shard_bytes += size
    return shards


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _torch_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    with open(path, "wb") as handle:
        torch.save(tensors, handle)


def _safetensors_writer(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str], *, hashed: bool
) -> Callable[[Path], Any]:
    """Writes a safetensors file: through the hashing writer (returning its manifest entry) or safetensors'."""
    if hashed:
        return lambda tmp: hashed_write.write_safetensors(tensors, tmp, metadata)
    return lambda tmp: save_file(tensors, tmp, metadata=metadata)


def _torch_writer(tensors: dict[str, torch.Tensor], *, hashed: bool) -> Callable[[Path], Any]:
    """Writes a ``.bin`` file: through the hashing writer (returning its manifest entry) or plainly."""
    if hashed:
        return lambda tmp: hashed_write.write_torch(tensors, tmp)
    return lambda tmp: _torch_save(tensors, tmp)


def _write_atomically(path: Path, write: Callable[[Path], Any], *, fsync: bool = True) -> Any:
    """Let ``write`` fill a temporary file next to ``path``, fsync it (unless told not to), and rename it to
    ``path``; returns what ``write`` returned."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        # safetensors (like tempfile.mkstemp) creates files as 0600; give the file the mode that open()
        # gives under the current umask, read back from a file we create, since reading the umask changes it.
        tmp.touch()
        mode = tmp.stat().st_mode & 0o777
        result = write(tmp)
        if tmp.stat().st_mode & 0o777 != mode:
            os.chmod(tmp, mode)
        if fsync:
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return result


def _remove_stale(directory: Path, keep: set[str]) -> None:
    """Delete weight files and indexes of earlier saves, in either format, that are not in ``keep``."""
    for entry in directory.iterdir():
        if entry.name not in keep and entry.is_file() and any(f.owns(entry.name) for f in _FORMATS):
            entry.unlink(missing_ok=True)


def _fsync_directory(directory: Path) -> None:
    """Make the renames durable (POSIX only; Windows cannot open a folder for fsync)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_model_files(directory: str | Path, *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read the weights that :func:`save_model_files` (or transformers' ``save_pretrained``) wrote.

    In a folder, safetensors files are preferred over ``.bin`` files, and an index over a single file.
    ``.bin`` files are read with ``torch.load(weights_only=True)`` only. Tied aliases come back as the
    same tensor object as their source.

    Args:
        directory: the folder, or one weight file or index inside it.
        device: where the tensors are placed.

    Returns:
        Every saved key mapped to its tensor.

    Raises:
        FileNotFoundError: the folder, its weight files, or a shard named in the index is missing.
        UnsafeCheckpointError: a ``.bin`` file holds arbitrary Python objects (they are not run).
        ValueError: a file or index is corrupt or inconsistent.

    Example:
        >>> state_dict = load_model_files("out/model")  # doctest: +SKIP
    """
    path = _locate(Path(directory))
    if path.name.endswith(".index.json"):
        return _load_sharded(path, device)
    tensors, tied = _read_weight_file(path, device)
    return _restore_tied(tensors, tied, path)


def holds_model_files(directory: Path) -> bool:
    """Whether ``directory`` is a folder with a weight file or index that :func:`load_model_files` reads."""
    return directory.is_dir() and any(
        (directory / name).is_file() for layout in _FORMATS for name in (layout.index, layout.single)
    )


def _locate(path: Path) -> Path:
    """The index or single weight file to read for ``path`` (a folder or a file)."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(
            f"load_model_files({str(path)!r}): no such folder or file. Pass the folder save_model_files wrote."
        )
    for layout in _FORMATS:
        for name in (layout.index, layout.single):
            if (path / name).is_file():
                return path / name
    wanted = ", ".join(name for layout in _FORMATS for name in (layout.index, layout.single))
    raise FileNotFoundError(
        f"load_model_files({str(path)!r}): the folder holds no model weights (looked for {wanted}); "
        f"it contains {_listing(path)}."
    )


def _listing(directory: Path, limit: int = 20) -> str:
    names = sorted(entry.name for entry in directory.iterdir())
    if not names:
        return "nothing"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _read_index(index_path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The ``weight_map`` and the tied aliases recorded in an index file."""
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        weight_map = index["weight_map"]
        tied = index.get("metadata", {}).get(TIED_KEY, {})
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(
            f"{index_path} is not a valid weight index ({type(error).__name__}: {error}); it must be JSON "
            'like {"metadata": {"total_size": ...}, "weight_map": {name: file}}.'
        ) from None
    if not isinstance(weight_map, dict) or not isinstance(tied, dict):
        raise ValueError(f"{index_path}: 'weight_map' and metadata['{TIED_KEY}'] must be JSON objects.")
    return weight_map, tied


def _load_sharded(index_path: Path, device: str | torch.device) -> dict[str, torch.Tensor]:
    """Read every shard an index names, then check that every key of its ``weight_map`` was found."""
    weight_map, tied = _read_index(index_path)
    files = list(dict.fromkeys(weight_map.values()))
    missing = [name for name in files if not (index_path.parent / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{index_path} names {len(files)} shard files but {len(missing)} are missing: "
            f"{', '.join(missing[:10])}. The folder contains {_listing(index_path.parent)}. "
            "The save was incomplete or files were deleted; save the model again."
        )
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        shard, shard_tied = _read_weight_file(index_path.parent / name, device)
        tensors.update(shard)
        tied.update(shard_tied)
    tensors = _restore_tied(tensors, tied, index_path)
    absent = [key for key in weight_map if key not in tensors]
    if absent:
        raise ValueError(
            f"{index_path} maps {len(absent)} keys to shards that do not hold them: {absent[:10]}. "
            "The shards come from a different save; save the model again."
        )
    return tensors


def _read_weight_file(
    path: Path, device: str | torch.device
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of one safetensors or ``.bin`` file, and the tied aliases its metadata records."""
    if path.suffix == ".bin":
        return _read_pickle(path, device), {}
    if path.suffix != ".safetensors":
        raise ValueError(
            f"load_model_files({str(path)!r}): expected a .safetensors, .bin or .index.json file."
        )
    try:
        with single_pass.reading(path), safe_open(path, framework="pt", device=str(device)) as handle:
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
            metadata = handle.metadata() or {}
    except SafetensorError as error:
        raise ValueError(f"{path} is not a valid safetensors file: {error}") from None
    return tensors, _tied_aliases(metadata, path)


def _tied_aliases(metadata: Mapping[str, str], path: Path) -> dict[str, str]:
    """The tied aliases a safetensors file's metadata records (alias name -> source name)."""
    try:
        tied = json.loads(metadata.get(TIED_KEY, "{}"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: metadata[{TIED_KEY!r}] is not valid JSON ({error}).") from None
    if not isinstance(tied, dict) or not all(isinstance(v, str) for v in tied.values()):
        raise ValueError(f"{path}: metadata[{TIED_KEY!r}] must map alias names to source names.")
    return tied


def _read_pickle(path: Path, device: str | torch.device) -> dict[str, torch.Tensor]:
    """``torch.load(weights_only=True)`` of a ``.bin`` file that must hold a flat ``{str: Tensor}`` dict."""
    try:
        loaded = safe_torch_load(path, map_location=device)
    except (KeyError, EOFError) as error:  # what torch.load raises for files that are not torch.save output
        raise ValueError(f"{path} is not a torch.save file ({type(error).__name__}: {error}).") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{path} holds a {type(loaded).__name__}, not a dict of tensors.")
    for key, value in loaded.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise ValueError(
                f"{path} maps {key!r} to a {type(value).__name__}; weight files hold only tensors."
            )
    return loaded


def _restore_tied(
    tensors: dict[str, torch.Tensor], tied: Mapping[str, str], where: Path
) -> dict[str, torch.Tensor]:
    """Add every alias as the very tensor of its source."""
    for alias, source in tied.items():
        if source not in tensors:
            raise ValueError(
                f"{where}: the tied weight {alias!r} aliases {source!r}, which no file holds. "
                "The save was incomplete; save the model again."
            )
        tensors[alias] = tensors[source]
    return tensors


def load_model_weights(model: torch.nn.Module, directory: str | Path, *, strict: bool = True) -> None:
    """Load the weight files in ``directory`` into ``model`` with ``load_state_dict``.

    Args:
        model: the module to fill; its tensors keep their devices.
        directory: what :func:`load_model_files` accepts.
        strict: require the files and the model to have exactly the same keys.

    Raises:
        ValueError: with ``strict``, keys are missing from the files or unknown to the model (the first 10
            of each are listed).

    Example:
        >>> load_model_weights(model, "out/model")  # doctest: +SKIP
    """
    path = _locate(Path(directory))
    destinations = model.state_dict()

    def check(saved: list[str]) -> None:
        if strict:
            _check_keys(model, directory, destinations, saved)

    state_dict = _read_in_one_pass(path, destinations if _loads_plainly(model) else {}, check)
    if state_dict is None:  # a .bin file, an index of shards, or a dtype the one-pass reader does not know
        state_dict = load_model_files(path)
        check(list(state_dict))
    model.load_state_dict(state_dict, strict=strict)  # a tensor read in place is its destination: no copy


def _read_in_one_pass(
    path: Path, into: Mapping[str, torch.Tensor], check: Callable[[list[str]], None]
) -> dict[str, torch.Tensor] | None:
    """A safetensors file read in one pass (hashed as read), straight into ``into``'s tensors; its keys
    (tied aliases included) go to ``check`` first, so a mismatch leaves them untouched. None for a file the
    one-pass reader cannot read (nothing read then)."""
    if not single_pass.readable_in_one_pass(path):
        return None

    def check_header(names: list[str], metadata: dict[str, str]) -> None:
        check([*names, *_tied_aliases(metadata, path)])

    try:
        tensors, metadata = single_pass.read_safetensors(path, into, check=check_header)
    except single_pass.NotReadableInOnePass:
        return None
    return _restore_tied(tensors, _tied_aliases(metadata, path), path)


def _loads_plainly(model: torch.nn.Module) -> bool:
    """Whether ``load_state_dict`` copies each saved tensor into the module tensor of the same name: no
    module transforms the state dict as it loads (pre-hooks, its own ``_load_from_state_dict``), so reading
    a file straight into those tensors is the same load."""
    default = torch.nn.Module._load_from_state_dict
    return all(
        not module._load_state_dict_pre_hooks and type(module)._load_from_state_dict is default
        for module in model.modules()
    )


def _check_keys(
    model: torch.nn.Module, directory: str | Path, destinations: Mapping[str, Any], saved: list[str]
) -> None:
    present = set(saved)
    missing = [key for key in destinations if key not in present]
    unexpected = [key for key in saved if key not in destinations]
    if missing or unexpected:
        raise ValueError(
            f"load_model_weights({type(model).__name__}, {str(directory)!r}): the files do not match "
            f"the model. Missing from the files ({len(missing)}): {missing[:10]}. Unknown to the model "
            f"({len(unexpected)}): {unexpected[:10]}. Load the weights of this architecture, or pass "
            "strict=False to load the keys that match."
        )
