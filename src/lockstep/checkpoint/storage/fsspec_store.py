"""Checkpoints on object storage (S3, GCS, Azure) and any other ``fsspec`` file system.

Object stores have no atomic rename, but every object appears whole or not at all. So a save:

1. removes what an earlier save left under the checkpoint's prefix (its manifest first, so that it stops
   counting before any of its files goes);
2. writes locally into a private temporary staging folder (save hooks, ``torch.save`` and DCP unchanged);
3. uploads each process's files to the checkpoint's prefix, then a marker ``.rank_{r}.done`` holding
   those files' sizes and XXH3-128 checksums;
4. on the main process, once every marker is there: writes ``manifest.json`` from them, last, then the
   ``latest`` pointer, then rotates.

A checkpoint counts only when its manifest is present and every file it lists has the listed size, so a
writer killed mid-upload leaves a prefix without a manifest: it is skipped, with a warning naming it, and
the previous checkpoint stays the newest valid one. Loading reads the manifest first, downloads the files
into a temporary folder and verifies every checksum before anything is read, except the shard files of
sharded (DCP) folders: they are checked by size here, and each process reads from the store only what it
needs, verifying its share of the files' checksums (:mod:`lockstep.checkpoint.storage.dcp_reader`).

``fsspec`` comes with torch; the backends are extras: ``pip install 'lockstep[s3]'`` (``[gcs]``,
``[azure]``), imported only when such a URL is given.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from lockstep.checkpoint import layout
from lockstep.checkpoint.storage.base import CheckpointStorage, Location

EXTRAS = {
    "s3": ("s3fs", "s3"),
    "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"),
    "gcs": ("gcsfs", "gcs"),
    "az": ("adlfs", "azure"),
    "abfs": ("adlfs", "azure"),
    "abfss": ("adlfs", "azure"),
}
"""URL scheme -> (the package that serves it, the lockstep extra that installs it)."""

S3_DEFAULTS: dict[str, Any] = {
    "config_kwargs": {"connect_timeout": 5, "read_timeout": 120, "retries": {"max_attempts": 3}}
}
"""s3fs options used unless given: a dead endpoint fails in seconds instead of botocore's minutes."""

PROBE_SECONDS = 30.0
"""The longest the reachability check may take, whatever the backend's own timeouts."""
MARKER_POLL_SECONDS = 0.2
DONE_MARKER = ".rank_{rank}.done"
FAILED_MARKER = ".rank_{rank}.failed"


def protocol_of(url: str) -> str:
    return url.split("://", 1)[0].lower()


def load_filesystem(url: str, options: dict[str, Any] | None) -> Any:
    """The fsspec file system serving ``url``, or an ImportError naming the extra to install."""
    import fsspec

    protocol = protocol_of(url)
    package, extra = EXTRAS.get(protocol, (None, None))
    try:
        filesystem_class = fsspec.get_filesystem_class(protocol)
    except ImportError as error:
        install = (
            f"pip install 'lockstep[{extra}]'" if extra else f"install the fsspec backend for {protocol}://"
        )
        raise ImportError(
            f"Checkpoints at {url!r} need {package or 'an fsspec backend'} for {protocol}:// URLs, which is not "
            f"installed ({error}). Run: {install}"
        ) from None
    except ValueError as error:
        raise ValueError(
            f"Checkpoint location {url!r} has the URL scheme {protocol}://, which no fsspec file system serves "
            f"({error}). Use a local path or an fsspec URL such as s3://bucket/run."
        ) from None
    given = dict(options or {})
    if protocol in ("s3", "s3a"):
        given = {**copy.deepcopy(S3_DEFAULTS), **given}
    return filesystem_class(**given)


class FsspecStorage(CheckpointStorage):
    """Checkpoints under a URL of an fsspec file system: uploads with the manifest written last.

    Args:
        url: a location on the file system (its scheme picks the file system).
        storage_options: keyword arguments for the file system (credentials, ``endpoint_url``, ...).
    """

    node_local = False
    local = False

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.fs = load_filesystem(url, storage_options)

    # -- names ------------------------------------------------------------------------------------
    def join(self, root: Location, name: str) -> str:
        return f"{str(root).rstrip('/')}/{name}"

    def name(self, location: Location) -> str:
        return str(location).rstrip("/").rsplit("/", 1)[-1]

    def parent(self, location: Location) -> str:
        return str(location).rstrip("/").rsplit("/", 1)[0]

    def _fresh(self, location: Location) -> None:
        """Forget cached listings: other processes write here too."""
        self.fs.invalidate_cache(str(location))

    def children(self, root: Location) -> list[Location]:
        root = str(root)
        with self._described(root):
            self._fresh(root)
            if not self.fs.exists(root):
                return []
            entries = self.fs.ls(root, detail=True)
        return [self.join(root, self.name(e["name"])) for e in entries if e["type"] == "directory"]

    def exists(self, location: Location) -> bool:
        self._fresh(str(location))
        return bool(self.fs.exists(str(location)))

    def remove(self, location: Location) -> None:
        self._clear(str(location))

    # -- reachability -----------------------------------------------------------------------------
    def probe(self) -> None:
        """Write and delete one small object under the URL, within :data:`PROBE_SECONDS`.

        Raises:
            FileNotFoundError: the bucket (or container) does not exist.
            PermissionError: no credentials, or credentials that may not write there.
            ConnectionError: the endpoint cannot be reached.
            TimeoutError: no answer within the limit.
        """
        target = self.join(self.url, f".lockstep-probe-{time.time_ns()}")
        outcome: list[BaseException | None] = []

        def attempt() -> None:
            try:
                self.fs.pipe_file(target, b"ok")
                self.fs.rm_file(target)
                outcome.append(None)
            except BaseException as error:
                outcome.append(error)

        started = time.monotonic()
        thread = threading.Thread(target=attempt, name="lockstep-storage-probe", daemon=True)
        thread.start()
        thread.join(PROBE_SECONDS)
        if not outcome:
            raise TimeoutError(
                f"Checkpoint storage {self.url!r} did not answer within {PROBE_SECONDS:.0f} s (writing a small "
                "test object). Check the endpoint (AWS_ENDPOINT_URL / storage_options endpoint_url) and network."
            )
        if outcome[0] is not None:
            raise describe_failure(self.url, outcome[0], time.monotonic() - started) from outcome[0]

    # -- saving -----------------------------------------------------------------------------------
    def prepare(self, final: Location, *, main: bool) -> Path:
        if main:
            self._clear(str(final))
        staging = Path(tempfile.mkdtemp(prefix="lockstep-staging-")) / self.name(final)
        staging.mkdir()
        return staging

    def _clear(self, location: str) -> None:
        """Delete a prefix, its manifest first (it stops counting before any other file goes)."""
        self._fresh(location)
        manifest = self.join(location, layout.MANIFEST_NAME)
        if self.fs.exists(manifest):
            self.fs.rm_file(manifest)
        if self.fs.exists(location):
            self.fs.rm(location, recursive=True)
        self._fresh(location)

    def discard(self, staging: Path, *, main: bool) -> None:
        shutil.rmtree(staging.parent, ignore_errors=True)  # every process's own temporary folder

    def rank_writer(
        self,
        write: Callable[[], None],
        staging: Path,
        final: Location,
        rank: int,
        *,
        background: bool,
        written: Mapping[str, dict[str, Any]] | None = None,
    ) -> Callable[[], None]:
        def work() -> None:
            try:
                write()
                facts = self._upload(staging, str(final), written or {})
                self.fs.pipe_file(self.join(final, DONE_MARKER.format(rank=rank)), json.dumps(facts).encode())
            except BaseException as error:
                with contextlib.suppress(Exception):
                    text = f"{type(error).__name__}: {error}".encode()
                    self.fs.pipe_file(self.join(final, FAILED_MARKER.format(rank=rank)), text)
                raise
            finally:
                shutil.rmtree(staging.parent, ignore_errors=True)

        return work

    def _upload(
        self, staging: Path, final: str, written: Mapping[str, dict[str, Any]]
    ) -> dict[str, dict[str, Any]]:
        """Upload every file of ``staging`` (concurrently where the backend can); returns their manifest
        entries: ``written``'s (computed as the files were written), the others' hashed now."""
        files = sorted(p for p in staging.rglob("*") if p.is_file())
        names = [p.relative_to(staging).as_posix() for p in files]
        facts = {
            name: dict(written[name]) if name in written else layout.file_facts(path)
            for name, path in zip(names, files)
        }
        if files:
            self.fs.put([str(p) for p in files], [self.join(final, name) for name in names])
        return facts

    def commit(
        self,
        staging: Path,
        final: Location,
        *,
        world_size: int,
        step: int,
        move_latest_pointer: bool,
        wait_seconds: float | None,
        known: Mapping[str, dict[str, Any]] | None = None,
    ) -> None:
        # `known` travelled in each rank's marker already (see rank_writer): the markers are what counts here
        final = str(final)
        files = self._gather_markers(final, world_size, 60.0 if wait_seconds is None else wait_seconds)
        manifest = layout.Manifest(files=files, world_size=world_size, step=step, created=time.time())
        self.fs.rm([self.join(final, DONE_MARKER.format(rank=r)) for r in range(world_size)])
        self.fs.pipe_file(
            self.join(final, layout.MANIFEST_NAME), json.dumps(manifest.to_json(), indent=1).encode()
        )
        if move_latest_pointer:
            self.fs.pipe_file(
                self.join(self.parent(final), layout.LATEST_POINTER), f"{self.name(final)}\n".encode()
            )

    def _gather_markers(self, final: str, world_size: int, timeout: float) -> dict[str, dict[str, Any]]:
        """Every rank's uploaded files, once each rank's marker is there."""
        deadline = time.monotonic() + timeout
        while True:
            self._fresh(final)
            names = set(self._sizes(final))  # one listing per poll, not one request per marker
            for rank in range(world_size):
                if FAILED_MARKER.format(rank=rank) in names:
                    reason = self.fs.cat_file(self.join(final, FAILED_MARKER.format(rank=rank))).decode()
                    raise RuntimeError(f"rank {rank} could not upload its part of {final}: {reason}")
            missing = [r for r in range(world_size) if DONE_MARKER.format(rank=r) not in names]
            if not missing:
                files: dict[str, dict[str, Any]] = {}
                for rank in range(world_size):
                    files.update(
                        json.loads(self.fs.cat_file(self.join(final, DONE_MARKER.format(rank=rank))))
                    )
                return dict(sorted(files.items()))
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {missing} did not finish uploading {final} within {timeout:.0f} s")
            time.sleep(MARKER_POLL_SECONDS)

    # -- finding and reading ----------------------------------------------------------------------
    @contextlib.contextmanager
    def _described(self, location: str) -> Iterator[None]:
        """Failures of the store itself (endpoint, credentials, bucket) as :func:`describe_failure` says them."""
        started = time.monotonic()
        try:
            yield
        except layout.CheckpointError:
            raise
        except Exception as error:
            raise describe_failure(location, error, time.monotonic() - started) from error

    def check(self, folder: Location, *, accelerate_layout: bool = True) -> None:
        """Manifest present and every file it lists there with its size (checksums: when read). A folder
        Accelerate wrote (no manifest) is refused whatever ``accelerate_layout`` says: on an object store
        a missing manifest is what an unfinished upload looks like."""
        with self._described(str(folder)):
            self._check(str(folder))

    def _check(self, folder: str) -> None:
        self._fresh(folder)
        manifest_path = self.join(folder, layout.MANIFEST_NAME)
        if not self.fs.exists(manifest_path):
            what = "does not exist" if not self.fs.exists(folder) else f"has no {layout.MANIFEST_NAME}"
            raise layout.CheckpointError(
                f"Checkpoint {folder} {what}: the save that wrote it did not finish (or it was not written by "
                "lockstep). It cannot be loaded safely."
            )
        manifest = layout.parse_manifest(self.fs.cat_file(manifest_path), folder)
        sizes = self._sizes(folder)
        for name, facts in manifest.files.items():
            if name not in sizes:
                raise layout.CheckpointError(
                    f"Checkpoint {folder} is missing {name}, which its manifest lists."
                )
            if sizes[name] != facts["size"]:
                raise layout.CheckpointError(
                    f"Checkpoint {folder}: {name} has {sizes[name]} bytes but the manifest says {facts['size']}."
                )

    def _sizes(self, folder: str) -> dict[str, int]:
        """Relative name -> size of every object under ``folder``."""
        prefix = self.fs._strip_protocol(folder).rstrip("/") + "/"
        found = self.fs.find(folder, detail=True)
        return {path.removeprefix(prefix): int(info["size"]) for path, info in found.items()}

    def automatic(self, root: Location) -> list[tuple[int, str]]:
        """``checkpoint_{i}`` prefixes under ``root``, oldest first."""
        found = [
            (layout._AUTOMATIC_NAME.match(self.name(folder)), str(folder)) for folder in self.children(root)
        ]
        return sorted((int(match.group(1)), folder) for match, folder in found if match)

    def newest_valid(self, root: Location, *, before: int | None = None) -> str:
        candidates = [
            folder for index, folder in reversed(self.automatic(root)) if before is None or index < before
        ]
        return layout.first_valid(candidates, self.check, root)

    def rotate(
        self, root: Location, total_limit: int | None, *, within_seconds: float | None = None
    ) -> list[Location]:
        if total_limit is None:
            return []
        checkpoints = self.automatic(root)
        doomed = [folder for _, folder in checkpoints[: max(0, len(checkpoints) - total_limit)]]
        for folder in doomed:
            self._clear(folder)
        return list(doomed)

    @contextlib.contextmanager
    def readable(self, folder: Location) -> Iterator[Path]:
        """Download ``folder`` into a temporary folder of the same name and verify every checksum there;
        sharded (DCP) folders' shard files stay in the store, read by each process as it needs them."""
        folder = str(folder)
        temporary = Path(tempfile.mkdtemp(prefix="lockstep-download-"))
        try:
            local = temporary / self.name(folder)
            self._fresh(folder)
            sizes = self._sizes(folder)
            shards = self._shards_read_in_place(folder, sizes)
            names = sorted(set(sizes) - set(shards))
            targets = [local / name for name in names]
            for target in targets:
                target.parent.mkdir(parents=True, exist_ok=True)
            if names:
                self.fs.get([self.join(folder, name) for name in names], [str(t) for t in targets])
            local.mkdir(parents=True, exist_ok=True)
            if layout.written_by_accelerate(local):
                yield local
                return
            manifest = layout.verify(local, elsewhere=shards)
            with _remote_shards(self, folder, local, manifest, sizes, shards):
                yield local
        finally:
            shutil.rmtree(temporary, ignore_errors=True)

    @contextlib.contextmanager
    def writable(
        self, folder: Location, *, upload: bool = True, fetch: tuple[str, ...] = ()
    ) -> Iterator[Path]:
        """A temporary folder whose files are uploaded under ``folder`` when the block ends without an error
        (``fetch``: files of ``folder`` downloaded into it first, where they exist)."""
        temporary = Path(tempfile.mkdtemp(prefix="lockstep-output-"))
        try:
            for name in fetch:
                remote = self.join(folder, name)
                if self.exists(remote):
                    self.fs.get(remote, str(temporary / name))
            yield temporary
            files = sorted(path for path in temporary.rglob("*") if path.is_file())
            if upload and files:
                remote_names = [self.join(folder, path.relative_to(temporary).as_posix()) for path in files]
                self.fs.put([str(path) for path in files], remote_names)
        finally:
            shutil.rmtree(temporary, ignore_errors=True)

    def _shards_read_in_place(self, folder: str, sizes: dict[str, int]) -> list[str]:
        """The DCP shard files (``*.distcp`` beside a ``.metadata``) that are not downloaded: each process
        reads what it needs from the store. None when torch has no ``FsspecReader``, or when there is no
        manifest to check them against (a checkpoint Accelerate wrote): then all are downloaded."""
        dcp_folders = {name.rsplit("/", 1)[0] for name in sizes if name.endswith("/.metadata")}
        shards = [n for n in sizes if n.endswith(".distcp") and n.rsplit("/", 1)[0] in dcp_folders]
        if not shards or layout.MANIFEST_NAME not in sizes:
            return []
        try:
            importlib.import_module("lockstep.checkpoint.storage.dcp_reader")
        except ImportError as error:
            import torch

            warnings.warn(
                f"torch {torch.__version__} has no fsspec reader for sharded checkpoints ({error}), so every "
                f"process downloads every shard of {folder}. With torch 2.13 (its FsspecReader) each process "
                "reads only what it needs.",
                stacklevel=3,
            )
            return []
        return sorted(shards)


@contextlib.contextmanager
def _remote_shards(
    storage: FsspecStorage,
    folder: str,
    local: Path,
    manifest: layout.Manifest,
    sizes: dict[str, int],
    shards: list[str],
) -> Iterator[None]:
    """While inside, DCP loads of ``local``'s sharded folders read the shard files from ``folder`` in the
    store, each checked against the manifest by size now and by checksum by one of the loading processes
    (:class:`~lockstep.checkpoint.storage.dcp_reader.SafeFsspecReader`)."""
    from lockstep.checkpoint import safe_dcp

    remote: dict[Path, safe_dcp.RemoteFolder] = {}
    for name in shards:
        facts = manifest.files.get(name)
        if facts is None or sizes[name] != facts["size"]:
            said = "is not listed" if facts is None else f"says {facts['size']} bytes"
            raise layout.CheckpointError(
                f"Checkpoint {folder}: {name} has {sizes[name]} bytes but the manifest {said}."
            )
        subfolder, file_name = name.rsplit("/", 1)
        entry = remote.setdefault(
            local / subfolder,
            safe_dcp.RemoteFolder(storage.join(folder, subfolder), storage.fs, local / subfolder, {}),
        )
        entry.files[file_name] = facts
    with safe_dcp.remote_shards(remote):
        yield


_FAILURES = (
    (
        ("NoCredentialsError", "PartialCredentialsError", "NoCredentials"),
        PermissionError,
        "found no credentials. Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass "
        "credentials in storage_options",
    ),
    (
        ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "Forbidden", "(403)"),
        PermissionError,
        "refused these credentials. Check the key, the secret and the bucket's permissions",
    ),
    (
        (
            "EndpointConnectionError",
            "ConnectTimeoutError",
            "ConnectionError",
            "ClientConnectorError",
            "Could not connect",
        ),
        ConnectionError,
        "is unreachable. Check the endpoint (AWS_ENDPOINT_URL or storage_options['endpoint_url']) and the network",
    ),
)


def describe_failure(url: str, error: BaseException, seconds: float) -> OSError:
    """A clear error for a store that failed: what was tried, why it failed, what to do."""
    text = f"{type(error).__name__}: {error}"
    names = {cls.__name__ for cls in type(error).__mro__}
    if isinstance(error, FileNotFoundError) or "NoSuchBucket" in text:
        bucket = url.split("://", 1)[-1].split("/", 1)[0]
        return FileNotFoundError(
            f"Checkpoint storage {url!r}: the bucket {bucket!r} does not exist ({text}). Create it, or fix the "
            "project_dir / output_dir URL."
        )
    # The error's own class first: its text names the endpoint, whose port may read like a status code.
    for matches in (
        lambda markers: bool(names & set(markers)),
        lambda markers: any(m in text for m in markers),
    ):
        for markers, kind, advice in _FAILURES:
            if matches(markers):
                return kind(f"Checkpoint storage {url!r} {advice} (after {seconds:.1f} s: {text}).")
    return OSError(f"Checkpoint storage {url!r} cannot be written (after {seconds:.1f} s: {text}).")
