"""The files the Trainer writes into ``output_dir`` itself (the final model, metrics, ``trainer_state.json``,
the model card), where ``output_dir`` may be an fsspec URL (``s3://bucket/run``).

Checkpoints go through :mod:`lockstep.checkpoint.storage` (staging, manifest last). These files are not
checkpoints: on a URL they are written into a temporary local folder, then uploaded under the URL, as
transformers users upload ``output_dir`` to the Hub. ``Path("s3://bucket/run")`` would instead be the local
folder ``s3:/bucket/run``, where nobody looks for them.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from lockstep.checkpoint import is_url, storage_for


@contextlib.contextmanager
def writable(output_dir: str, *, upload: bool = True, fetch: tuple[str, ...] = ()) -> Iterator[Path]:
    """A local folder standing for ``output_dir``: the folder itself when it is local (``file://`` too), else
    a temporary folder whose files are uploaded under the URL when the block ends without an error.

    Args:
        output_dir: a local folder or an fsspec URL.
        upload: whether this process uploads what it wrote (the process that writes: the main one).
        fetch: files of the URL copied into the temporary folder first, where they exist (to be updated).

    Example:
        >>> with writable("memory://run/out") as folder:  # doctest: +SKIP
        ...     (folder / "all_results.json").write_text("{}")  # uploaded to memory://run/out/all_results.json
    """
    if not is_url(output_dir):
        yield Path(str(output_dir).removeprefix("file://"))
        return
    storage = storage_for(output_dir)
    filesystem = storage.fs  # type: ignore[attr-defined]  # a URL's storage is an FsspecStorage
    temporary = Path(tempfile.mkdtemp(prefix="lockstep-output-"))
    try:
        for name in fetch:
            remote = storage.join(output_dir, name)
            if storage.exists(remote):
                filesystem.get(str(remote), str(temporary / name))
        yield temporary
        files = sorted(path for path in temporary.rglob("*") if path.is_file())
        if upload and files:
            remote_names = [str(storage.join(output_dir, p.relative_to(temporary).as_posix())) for p in files]
            filesystem.put([str(p) for p in files], remote_names)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
