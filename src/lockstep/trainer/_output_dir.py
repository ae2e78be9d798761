"""The files the Trainer writes into ``output_dir`` itself (the final model, metrics, ``trainer_state.json``,
the model card), where ``output_dir`` may be an fsspec URL (``s3://bucket/run``).

Checkpoints go through :mod:`lockstep.checkpoint.storage` (staging, manifest last). These files are not
checkpoints: the storage of ``output_dir`` gives a local folder for them (:meth:`CheckpointStorage.writable
<lockstep.checkpoint.storage.base.CheckpointStorage.writable>`): on a URL a temporary one, uploaded under the URL, as
transformers users upload ``output_dir`` to the Hub. ``Path("s3://bucket/run")`` would instead be the local
folder ``s3:/bucket/run``, where nobody looks for them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from lockstep.checkpoint import storage_for


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
    with storage_for(output_dir).writable(output_dir, upload=upload, fetch=fetch) as folder:
        yield folder
