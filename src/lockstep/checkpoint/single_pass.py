"""Verifying a checkpoint's large files in the same pass that reads them.

Loading a checkpoint verifies every file's XXH3-128 checksum. Hashing the files on a thread while the loader
reads them costs a second pass over the bytes, and on a machine with few cores it competes with the load.
Here the loader hashes what it reads, chunk by chunk, each chunk while it is still in the CPU cache:

- :func:`load_torch_file`: a ``torch.save`` file (the optimizer's ``optimizer.bin``): ``torch.load`` with
  ``map_location="meta"`` reads only its pickle and record offsets, then each record is read into a new
  storage of its own, as ``torch.load`` allocates them. A mismatching checksum is raised before the tensors
  are returned.
- :func:`read_safetensors`: a safetensors file (``model.safetensors``) is read straight into the model's own
  tensors where their dtype and shape match (no intermediate copy), the others into new tensors. A file
  with a dtype this reader does not know raises :class:`NotReadableInOnePass` before reading any tensor.

Which files to hash, and the digests computed, travel in a :class:`ReadChecks` set for the duration of a
load (:func:`hashing_reads`); readers outside one read as before.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import sys
import threading
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

CHUNK_BYTES = 2 << 20
"""Bytes read and hashed at a time: small enough to be hashed from the CPU cache."""


@dataclass
class ReadChecks:
    """The files the loader hashes as it reads them, and the digests it computed."""

    expected: dict[Path, str]
    """Resolved path -> the XXH3-128 hex digest the manifest records."""
    computed: dict[Path, str] = field(default_factory=dict)


_ACTIVE: ContextVar[ReadChecks | None] = ContextVar("lockstep_single_pass_checks", default=None)


@contextlib.contextmanager
def hashing_reads(checks: ReadChecks) -> Iterator[None]:
    """Within the block, the readers of this module hash the files of ``checks`` as they read them."""
    token = _ACTIVE.set(checks)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


_FAILED_READS: ContextVar[list[tuple[Path, BaseException]] | None] = ContextVar(
    "lockstep_failed_reads", default=None
)


@contextlib.contextmanager
def recording_read_failures() -> Iterator[list[tuple[Path, BaseException]]]:
    """Within the block, the checkpoint readers record each file they fail to read with the error: the
    loader then names the file (:func:`failed_file`). Outside one, they raise as they always did."""
    failures: list[tuple[Path, BaseException]] = []
    token = _FAILED_READS.set(failures)
    try:
        yield failures
    finally:
        _FAILED_READS.reset(token)


@contextlib.contextmanager
def reading(path: Path | str) -> Iterator[None]:
    """The read of ``path`` (its bytes and their parsing, not what the caller checks of them): an error
    escaping it is recorded where :func:`recording_read_failures` is active, then raised unchanged."""
    try:
        yield
    except Exception as error:
        failures = _FAILED_READS.get()
        if failures is not None:
            failures.append((Path(path), error))
        raise


def failed_file(error: BaseException, failures: list[tuple[Path, BaseException]]) -> Path | None:
    """The file whose read raised ``error``, or an error ``error`` was raised from (None: not a read)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for path, failure in failures:
            if failure is current:
                return path
        current = current.__cause__ or current.__context__
    return None


def expects(path: Path | str) -> bool:
    """Whether the current load wants ``path`` hashed as it is read."""
    checks = _ACTIVE.get()
    return checks is not None and Path(path).resolve() in checks.expected


def _record(path: Path, digest: str) -> None:
    checks = _ACTIVE.get()
    if checks is not None:
        checks.computed[path.resolve()] = digest


class ChecksumMismatch(ValueError):
    """A file read in one pass does not match the checksum its manifest records."""


class HashedReader:
    """A file read front to back into the caller's buffers, every byte hashed once as it lands.

    The hashing runs on a thread one chunk behind the reading (both release the GIL), so a verified read
    takes about as long as the read alone where there is a second core; chunks are hashed while they are
    still in the CPU cache. The caller must leave a buffer unchanged until :meth:`finish` returns.
    """

    def __init__(self, path: Path, *, hashing: bool = True) -> None:
        self.path = path
        self.handle = open(path, "rb", buffering=0)  # closed by close()
        self.position = 0
        self.hashing = hashing
        self._digest = xxhash.xxh3_128()
        self._chunks: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._hasher = threading.Thread(target=self._hash, name="lockstep-hash-while-read", daemon=True)
        if hashing:
            self._hasher.start()

    def _hash(self) -> None:
        while (chunk := self._chunks.get()) is not None:
            self._digest.update(chunk)

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` (bytes) from the file; EOFError when the file ends first."""
        filled = 0
        while filled < len(view):
            chunk = view[filled : filled + CHUNK_BYTES]
            count = self.handle.readinto(chunk)
            if not count:
                raise EOFError(f"{self.path} ended at byte {self.position} (truncated?)")
            if self.hashing:
                self._chunks.put(chunk[:count])
            filled += count
            self.position += count

    def read_bytes(self, count: int) -> bytes:
        buffer = bytearray(count)
        self.read_into(memoryview(buffer))
        return bytes(buffer)

    def finish(self) -> str:
        """Hash the rest of the file; the digest of all of it ("" for a reader that does not hash)."""
        if not self.hashing:
            return ""
        while chunk := self.handle.read(CHUNK_BYTES):
            self._chunks.put(memoryview(chunk))
            self.position += len(chunk)
        self._stop_hashing()
        digest = self._digest.hexdigest()
        _record(self.path, digest)
        return digest

    def _stop_hashing(self) -> None:
        if self._hasher.is_alive():
            self._chunks.put(None)
            self._hasher.join()

    def close(self) -> None:
        self._stop_hashing()
        self.handle.close()


def _check(path: Path, digest: str) -> None:
    checks = _ACTIVE.get()
    expected = checks.expected.get(path.resolve()) if checks is not None else None
    if expected is not None and digest != expected:
        raise ChecksumMismatch(f"{path} does not match the checksum its manifest records (corrupt).")


# -- torch.save files --------------------------------------------------------------------------------------
class _NotViewable(Exception):
    """The file holds something other than plain tensors in dicts, lists and tuples (then it is loaded as
    usual and hashed after)."""


def load_torch_file(path: Path) -> Any:
    """``torch.load(path, weights_only=True)`` onto the CPU, its bytes read and hashed in one pass.

    Call inside ``torch.serialization.safe_globals`` as for ``torch.load``. ``torch.load`` with
    ``map_location="meta"`` reads the pickle and the records' offsets only; then the file is read front to
    back, each storage's record into a new storage of its own (as ``torch.load`` allocates them), every byte
    hashed once. Raises :class:`ChecksumMismatch` when the bytes do not match the expected checksum.
    """
    if sys.byteorder != "little" or _byte_order(path) != "little":
        return _load_then_hash(path)
    skeleton = torch.load(path, map_location="meta", weights_only=True)
    views = _Views()
    try:
        views.collect(skeleton)
    except _NotViewable:
        return _load_then_hash(path)
    reader = HashedReader(path)
    try:
        for offset, storage in sorted(views.storages.items()):
            reader.read_bytes(offset - reader.position)
            reader.read_into(memoryview(storage.numpy()))
        digest = reader.finish()
    except (EOFError, ValueError) as error:  # a record past the end, or out of order: not torch.save's file
        raise ChecksumMismatch(f"{path} could not be read in one pass: {error}") from None
    finally:
        reader.close()
    _check(path, digest)
    return views.of(skeleton)


def _load_then_hash(path: Path) -> Any:
    """The two-pass fallback: ``torch.load``, then the file hashed."""
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    reader = HashedReader(path)
    try:
        _check(path, reader.finish())
    finally:
        reader.close()
    return loaded


def _byte_order(path: Path) -> str | None:
    """The byte order a ``torch.save`` zip file records (files before the record are little-endian); None
    for a file that is not a zip file (a raw pickle, which ``torch.load`` reads, or refuses, itself)."""
    try:
        with zipfile.ZipFile(path) as archive:
            for name in archive.namelist():
                if name.endswith("/byteorder"):
                    return archive.read(name).decode("ascii", "replace").strip()
    except zipfile.BadZipFile:
        return None
    return "little"


class _Views:
    """The storages a ``map_location="meta"`` load refers to (by offset in the file, each to be filled from
    its record), and the loaded structure rebuilt with real tensors over them."""

    def __init__(self) -> None:
        self.storages: dict[int, torch.Tensor] = {}
        """Offset of a record in the file -> the bytes (uint8) its storage is read into."""
        self.done: dict[int, torch.Tensor] = {}

    def collect(self, value: Any) -> None:
        for meta in _tensors(value):
            if meta.device.type != "meta" or type(meta) not in (torch.Tensor, torch.nn.Parameter):
                raise _NotViewable
            offset = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
            if offset is None:
                raise _NotViewable
            if offset not in self.storages:
                self.storages[offset] = torch.empty(meta.untyped_storage().nbytes(), dtype=torch.uint8)

    def of(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if isinstance(value, dict):
            rebuilt = {key: self.of(item) for key, item in value.items()}
            return rebuilt if type(value) is dict else type(value)(rebuilt)
        if type(value) in (list, tuple):
            return type(value)(self.of(item) for item in value)
        return value

    def _tensor(self, meta: torch.Tensor) -> torch.Tensor:
        if id(meta) not in self.done:
            storage = self.storages[meta.untyped_storage()._checkpoint_offset].untyped_storage()
            real = torch.empty(0, dtype=meta.dtype)
            real.set_(storage, meta.storage_offset(), meta.size(), meta.stride())
            if isinstance(meta, torch.nn.Parameter):
                real = torch.nn.Parameter(real, requires_grad=meta.requires_grad)
            elif meta.requires_grad:
                real.requires_grad_(True)
            self.done[id(meta)] = real
        return self.done[id(meta)]


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a loaded structure of dicts, lists and tuples (other containers: not viewable)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif type(value) in (list, tuple):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, (list, tuple, set, frozenset)):  # named tuples and other subclasses
        raise _NotViewable


# -- safetensors files -------------------------------------------------------------------------------------
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    **{
        name: getattr(torch, dtype)
        for name, dtype in (
            ("U16", "uint16"),
            ("U32", "uint32"),
            ("U64", "uint64"),
            ("F8_E8M0", "float8_e8m0fnu"),
        )
        if hasattr(torch, dtype)  # in recent torch versions only
    },
}


class NotReadableInOnePass(ValueError):
    """A safetensors file holds a dtype :func:`read_safetensors` does not know (the safetensors library may)."""


def readable_in_one_pass(path: Path) -> bool:
    """Whether :func:`read_safetensors` can read ``path`` (else it is read with the safetensors library)."""
    return sys.byteorder == "little" and path.suffix == ".safetensors"


def _metadata(header: Mapping[str, Any]) -> dict[str, str]:
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        return {}
    return {str(key): str(value) for key, value in metadata.items()}


def _parse_header(path: Path, length_bytes: bytes, read: Any) -> dict[str, Any]:
    if len(length_bytes) != 8:
        raise ValueError(f"{path} is not a valid safetensors file: it is shorter than its header.")
    length = int.from_bytes(length_bytes, "little")
    if length > os.stat(path).st_size:
        raise ValueError(
            f"{path} is not a valid safetensors file: its header length {length} is past its end."
        )
    try:
        header = json.loads(bytes(read(length)))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(
            f"{path} is not a valid safetensors file: its header is not JSON ({error})."
        ) from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a valid safetensors file: its header is not a JSON object.")
    return header


@dataclass
class _Entry:
    name: str
    dtype: torch.dtype
    shape: list[int]
    begin: int
    end: int


def _entries(path: Path, header: Mapping[str, Any]) -> list[_Entry]:
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if isinstance(info, dict) and info.get("dtype") not in SAFETENSORS_DTYPES:
            raise NotReadableInOnePass(f"{path}: {name!r} has dtype {info.get('dtype')!r}.")
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            begin, end = (int(x) for x in info["data_offsets"])
            shape = [int(x) for x in info["shape"]]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path} is not a valid safetensors file: entry {name!r} is {info!r}.") from None
        numel = 1
        for extent in shape:
            numel *= extent
        if end - begin != numel * dtype.itemsize or begin < 0:
            raise ValueError(
                f"{path} is not a valid safetensors file: {name!r} spans {end - begin} bytes for {numel} "
                f"elements of {dtype}."
            )
        entries.append(_Entry(name, dtype, shape, begin, end))
    return sorted(entries, key=lambda entry: entry.begin)


def _fits(destination: torch.Tensor, entry: _Entry) -> bool:
    return (
        destination.device.type == "cpu"
        and destination.dtype == entry.dtype
        and list(destination.shape) == entry.shape
        and destination.is_contiguous()
        and type(destination) in (torch.Tensor, torch.nn.Parameter)
    )


def read_safetensors(
    path: Path,
    destinations: Mapping[str, torch.Tensor],
    *,
    check: Callable[[list[str], dict[str, str]], None] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a safetensors file, read and hashed in one pass.

    A tensor whose destination (by name) is on the CPU, contiguous, with the same dtype and shape is read
    straight into it, and the destination itself is returned for that name; the others are new tensors.
    ``check(names, metadata)`` runs once the header is read, before any tensor is: what it raises leaves
    every destination untouched.
    Where the current :class:`ReadChecks` expects the file, its digest is recorded there (compared by the
    caller of the load); elsewhere nothing is hashed.
    """
    reader = HashedReader(path, hashing=expects(path))  # other ranks read without hashing
    try:
        with reading(path):
            header = _parse_header(path, reader.read_bytes(8), reader.read_bytes)
            entries = _entries(path, header)
        if check is not None:
            check([entry.name for entry in entries], _metadata(header))
        with reading(path):
            tensors = _read_entries(path, reader, entries, destinations)
    except EOFError as error:
        raise ValueError(f"{path} is not a valid safetensors file: {error}") from None
    finally:
        reader.close()
    return tensors, _metadata(header)


def _read_entries(
    path: Path, reader: HashedReader, entries: list[_Entry], destinations: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file whose header ``reader`` has read (into their destinations where
    they fit), and the rest of the file hashed."""
    data_start = reader.position
    tensors: dict[str, torch.Tensor] = {}
    for entry in entries:
        gap = data_start + entry.begin - reader.position
        if gap < 0:
            raise ValueError(f"{path} is not a valid safetensors file: {entry.name!r} overlaps another.")
        reader.read_bytes(gap)
        destination = destinations.get(entry.name)
        fits = destination is not None and _fits(destination, entry)
        target = destination.detach() if fits else torch.empty(entry.shape, dtype=entry.dtype)
        if target.numel():
            reader.read_into(memoryview(target.reshape(-1).view(torch.uint8).numpy()))
        tensors[entry.name] = target
    reader.finish()
    return tensors
