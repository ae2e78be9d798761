"""Checkpoint files written with their checksum taken from the bytes written.

A manifest that hashes the files from the disk after they were written certifies whatever is there when it
runs: a file torn between the write and the hash (truncated by a user's copy or clean-up, by another
program) got a manifest vouching for the torn bytes, and ``load_state`` then failed inside ``torch.load``
instead of skipping the checkpoint. The writers here hash every chunk as it is handed to the operating
system, while it is still in the CPU cache, and return the file's manifest entry (size and XXH3-128).
Measured here on 300 MB: hashing alone 15 ms, writing alone 58 ms, both chunk by chunk 66 ms.

Files a save does not write itself (those of save hooks, a sharding backend's DCP shards) are hashed from
the disk by the committing process before ``save_state`` returns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import xxhash

from lockstep.checkpoint import single_pass

CHUNK_BYTES = 1 << 20
"""Bytes hashed then written at a time: small enough to be hashed from the CPU cache."""

Facts = dict[str, Any]
"""A manifest entry: ``{"size": bytes, "xxh3_128": hex digest}``."""


class HashingFile:
    """A file opened for writing (created or emptied) whose bytes are hashed as they are written.

    It has the ``write`` that ``torch.save`` needs of a file object. :meth:`facts` is the manifest entry of
    everything written so far.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._handle = open(path, "wb", buffering=0)  # closed by close() or the with block
        self._digest = xxhash.xxh3_128()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), CHUNK_BYTES):
            chunk = view[start : start + CHUNK_BYTES]
            self._digest.update(chunk)
            done = 0
            while done < len(chunk):  # a raw file may take part of a write
                done += self._handle.write(chunk[done:])
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        """Nothing is buffered here (the bytes go to the operating system as written)."""

    def close(self) -> None:
        self._handle.close()

    def facts(self) -> Facts:
        return {"size": self.size, "xxh3_128": self._digest.hexdigest()}

    def __enter__(self) -> HashingFile:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()


def write_bytes(path: Path | str, data: bytes) -> Facts:
    """Write ``data`` to ``path``; returns its manifest entry."""
    with HashingFile(path) as handle:
        handle.write(data)
        return handle.facts()


def write_text(path: Path | str, text: str) -> Facts:
    """Write ``text`` (UTF-8) to ``path``; returns its manifest entry."""
    return write_bytes(path, text.encode("utf-8"))


def write_torch(value: Any, path: Path | str) -> Facts:
    """``torch.save(value, path)`` through a hashing file; returns its manifest entry. (The archive inside
    the file is named ``archive`` rather than after the file: ``torch.load`` reads either.)"""
    with HashingFile(path) as handle:
        torch.save(value, handle)
        return handle.facts()


_DTYPE_NAMES = {dtype: name for name, dtype in single_pass.SAFETENSORS_DTYPES.items()}


def write_safetensors(
    tensors: Mapping[str, torch.Tensor], path: Path | str, metadata: Mapping[str, str] | None = None
) -> Facts:
    """A safetensors file of ``tensors`` (contiguous CPU tensors that share no memory, as
    ``safetensors.torch.save_file`` takes them), written and hashed in one pass; returns its manifest entry.

    The layout is the format's: an 8-byte little-endian header length, the JSON header (``__metadata__``,
    then each tensor's dtype, shape and byte range, in the order given) padded with spaces to a multiple of
    8 bytes, then the tensors' bytes back to back.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        dtype = _DTYPE_NAMES.get(tensor.dtype)
        if dtype is None:  # pragma: no cover - every dtype safetensors stores is in the table
            raise TypeError(
                f"write_safetensors: {name!r} has dtype {tensor.dtype}, which safetensors cannot store."
            )
        header[name] = {
            "dtype": dtype,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with HashingFile(path) as handle:
        handle.write(len(text).to_bytes(8, "little"))
        handle.write(text)
        for tensor in tensors.values():
            if tensor.numel():
                handle.write(tensor.detach().reshape(-1).view(torch.uint8).numpy())
        return handle.facts()
