"""Checkpoints on object storage: memory:// units, and a real S3 API on loopback (moto in server mode).

Save, rotate and resume bitwise (2 gloo processes); a writer killed mid-upload (rank 0 alone, or rank 1 of 2
while rank 0 lives on) leaves the previous checkpoint the newest valid one; a dead endpoint, a missing bucket
or missing credentials fail before training, fast.
"""

import contextlib
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lockstep import Accelerator, ProjectConfiguration
from lockstep.checkpoint import CheckpointError
from lockstep.checkpoint.storage import LocalStorage, fsspec_store, scheme_of, storage_for
from tests.helpers.cli import REPO, SCRIPTS, cli_env
from tests.helpers.deadlines import scaled
from tests.helpers.multiprocess import run_distributed
from tests.helpers.ports import held_store

fsspec = pytest.importorskip("fsspec")


# -- memory:// --------------------------------------------------------------------------------------
@pytest.fixture
def memory_url():
    url = f"memory://lockstep-tests/{uuid.uuid4().hex}"
    yield url
    filesystem = fsspec.filesystem("memory")
    if filesystem.exists(url):
        filesystem.rm(url, recursive=True)


def _accelerator(url: str, **config) -> tuple[Accelerator, nn.Module, torch.optim.Optimizer]:
    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=url, **config))
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def _step(accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    accelerator.backward(model(torch.ones(3, 4)).sum())
    optimizer.step()
    optimizer.zero_grad()


def _names(filesystem, root: str) -> list[str]:
    filesystem.invalidate_cache(root)
    return sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in filesystem.ls(root, detail=False))


def test_paths_choose_their_storage():
    assert isinstance(storage_for("runs/a"), LocalStorage)
    assert isinstance(storage_for("file:///tmp/runs/a"), LocalStorage)  # atomic renames: the local protocol
    assert storage_for("file:///tmp/runs/a").join("file:///tmp/runs/a", "c").as_posix() == "/tmp/runs/a/c"
    schemes = [scheme_of(p) for p in ("s3://b/r", "MEMORY://r", "runs/a", "C:/runs")]
    assert schemes == ["s3", "memory", "file", "file"]
    assert type(storage_for("memory://r")).__name__ == "FsspecStorage"


@pytest.mark.skipif(
    any(importlib.util.find_spec(name) for name in ("gcsfs", "adlfs")), reason="the backends are installed"
)
def test_a_missing_backend_names_the_extra_and_an_unknown_scheme_is_refused():
    with pytest.raises(ImportError, match=r"gs:// URLs.*Run: pip install 'lockstep\[gcs\]'"):
        storage_for("gs://bucket/run")
    with pytest.raises(ImportError, match=r"pip install 'lockstep\[azure\]'"):
        Accelerator(project_dir="az://container/run")
    with pytest.raises(
        ValueError, match=r"'nosuch://x/run' has the URL scheme nosuch://, which no registered"
    ):
        storage_for("nosuch://x/run")


def test_save_rotate_and_resume_on_memory(memory_url):
    accelerator, model, optimizer = _accelerator(memory_url, automatic_checkpoint_naming=True, total_limit=2)
    saved = []
    for _ in range(3):
        _step(accelerator, model, optimizer)
        saved.append(model.weight.detach().clone())
        assert accelerator.save_state() == f"{memory_url}/checkpoints/checkpoint_{len(saved) - 1}"
    filesystem = fsspec.filesystem("memory")
    root = f"{memory_url}/checkpoints"
    assert _names(filesystem, root) == ["checkpoint_1", "checkpoint_2", "latest"]
    assert filesystem.cat_file(f"{root}/latest") == b"checkpoint_2\n"
    assert not [p for p in filesystem.find(f"{root}/checkpoint_2") if ".rank_" in p]  # markers removed

    again, model2, _ = _accelerator(memory_url, automatic_checkpoint_naming=True, total_limit=2)
    with torch.no_grad():
        model2.weight.zero_()
    assert again.resume_from_latest_checkpoint() == f"{root}/checkpoint_2"
    assert torch.equal(model2.weight, saved[2])
    assert again.project_configuration.iteration == 3


def test_an_incomplete_newest_checkpoint_is_skipped_with_a_warning(memory_url):
    accelerator, model, optimizer = _accelerator(memory_url, automatic_checkpoint_naming=True)
    _step(accelerator, model, optimizer)
    accelerator.save_state()
    accelerator.save_state()
    filesystem = fsspec.filesystem("memory")
    root = f"{memory_url}/checkpoints"
    filesystem.rm_file(f"{root}/checkpoint_1/manifest.json")  # what a writer killed mid-upload leaves
    filesystem.pipe_file(f"{root}/checkpoint_2/model.safetensors", b"torn")
    with pytest.warns(UserWarning, match=r"Skipped 2 newer checkpoint\(s\).*using .*checkpoint_0") as caught:
        accelerator.load_state()
    message = str(caught[0].message)
    assert f"{root}/checkpoint_2 has no manifest.json" in message
    assert f"{root}/checkpoint_1 has no manifest.json" in message


def test_a_wrong_size_is_skipped_and_a_corrupt_file_fails_its_checksum_on_load(memory_url):
    accelerator, model, optimizer = _accelerator(memory_url, automatic_checkpoint_naming=True)
    _step(accelerator, model, optimizer)
    accelerator.save_state()
    accelerator.save_state()
    filesystem = fsspec.filesystem("memory")
    root = f"{memory_url}/checkpoints"
    good = filesystem.cat_file(f"{root}/checkpoint_1/optimizer.bin")
    filesystem.pipe_file(f"{root}/checkpoint_1/optimizer.bin", good[:-3])
    with pytest.warns(UserWarning, match=r"optimizer.bin has \d+ bytes but the manifest says \d+"):
        accelerator.load_state()
    flipped = bytes([good[-1] ^ 0xFF])
    filesystem.pipe_file(f"{root}/checkpoint_1/optimizer.bin", good[:-1] + flipped)
    with pytest.raises(CheckpointError, match=r"checkpoint_1: optimizer.bin is corrupt \(its xxh3_128"):
        accelerator.load_state(f"{root}/checkpoint_1")


def test_saving_over_a_checkpoint_replaces_every_file(memory_url):
    accelerator, model, optimizer = _accelerator(memory_url)
    folder = f"{memory_url}/manual"
    filesystem = fsspec.filesystem("memory")
    filesystem.pipe_file(f"{folder}/stale.bin", b"from an older save")
    _step(accelerator, model, optimizer)
    assert accelerator.save_state(folder) == folder
    assert "stale.bin" not in _names(filesystem, folder)
    with torch.no_grad():
        model.weight.add_(1.0)
    expected = model.weight.detach().clone()
    accelerator.save_state(folder)
    with torch.no_grad():
        model.weight.zero_()
    accelerator.load_state(folder)
    assert torch.equal(model.weight, expected)


def test_without_torchs_fsspec_reader_every_shard_is_downloaded_with_a_warning(memory_url, monkeypatch):
    storage = storage_for(memory_url)
    sizes = {"pytorch_model_fsdp_0/.metadata": 9, "pytorch_model_fsdp_0/__0_0.distcp": 9, "stray.distcp": 9}
    assert storage._shards_read_in_place(memory_url, sizes) == []  # no manifest to check them against
    sizes["manifest.json"] = 9
    assert storage._shards_read_in_place(memory_url, sizes) == ["pytorch_model_fsdp_0/__0_0.distcp"]
    monkeypatch.setitem(sys.modules, "lockstep.checkpoint.storage.dcp_reader", None)  # as if torch lacked it
    message = (
        rf"torch {re.escape(torch.__version__)} has no fsspec reader .* downloads every shard of {memory_url}"
    )
    with pytest.warns(UserWarning, match=message):
        assert storage._shards_read_in_place(memory_url, sizes) == []


def test_a_shard_read_in_place_is_checked_against_the_manifest_by_its_share_of_processes(
    memory_url, tmp_path
):
    from torch.distributed.checkpoint.planner import LoadPlan

    from lockstep.checkpoint import layout
    from lockstep.checkpoint.safe_dcp import RemoteFolder
    from lockstep.checkpoint.storage.dcp_reader import SafeFsspecReader

    (tmp_path / "saved").write_bytes(b"weights")
    filesystem = fsspec.filesystem("memory")
    filesystem.pipe_file(f"{memory_url}/m/__0_0.distcp", b"weightz")  # same size, corrupt
    remote = RemoteFolder(
        f"{memory_url}/m", filesystem, tmp_path, {"__0_0.distcp": layout.file_facts(tmp_path / "saved")}
    )
    with pytest.raises(
        CheckpointError, match=r"m/__0_0.distcp is corrupt \(its size or xxh3_128 checksum does"
    ):
        SafeFsspecReader(remote, (0, 2)).read_data(LoadPlan([]), None)
    SafeFsspecReader(remote, (1, 2)).read_data(
        LoadPlan([]), None
    ).wait()  # rank 1 of 2 checks file 1, none here
    SafeFsspecReader(remote, None).read_data(LoadPlan([]), None).wait()  # sizes only (checked on listing)
    filesystem.pipe_file(f"{memory_url}/m/__0_0.distcp", b"weights")
    SafeFsspecReader(remote, (0, 1)).read_data(LoadPlan([]), None).wait()


def test_a_probe_that_never_answers_times_out(memory_url, monkeypatch):
    storage = storage_for(memory_url)
    monkeypatch.setattr(fsspec_store, "PROBE_SECONDS", 0.3)
    monkeypatch.setattr(storage.fs, "pipe_file", lambda *args, **kwargs: time.sleep(5))
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not answer within 0 s \(writing a small test object\)"):
        storage.probe()
    assert time.monotonic() - started < 2.0


# -- S3 on loopback (moto) --------------------------------------------------------------------------
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server on a free loopback port, with one bucket; the AWS_* variables point at it."""
    pytest.importorskip("s3fs")
    server_module = pytest.importorskip("moto.server")
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    port = server._server.server_port  # bound to port 0 and held by the server: no other process can take it
    env = {**AWS_ENV, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().mkdir("s3://lockstep-bucket")
    yield env
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def s3_url(s3_endpoint):
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    return f"s3://lockstep-bucket/{uuid.uuid4().hex}"


def _s3():
    import s3fs

    return s3fs.S3FileSystem()


class Progress:
    def __init__(self) -> None:
        self.done = 0

    def state_dict(self) -> dict:
        return {"done": self.done}

    def load_state_dict(self, state: dict) -> None:
        self.done = state["done"]


TOTAL_STEPS = 8  # 2 epochs of 4 batches per rank; a checkpoint every 2 steps


def _train_on_s3(url: str, stop_at: int | None, seed: int) -> tuple:
    torch.manual_seed(seed)
    project = ProjectConfiguration(project_dir=url, automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(project_config=project)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 6, generator=generator), torch.randn(32, 1, generator=generator))
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, DataLoader(data, batch_size=4, shuffle=True)
    )
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    resumed = accelerator.resume_from_latest_checkpoint()
    losses = []
    while progress.done < TOTAL_STEPS:
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            progress.done += 1
            if progress.done % 2 == 0:  # uploaded in the background while the next steps run
                accelerator.save_state(async_save=True)
            if progress.done in (stop_at, TOTAL_STEPS):
                break
        if progress.done == stop_at:
            accelerator.wait_for_checkpoint()
            return resumed, losses, None, None
    accelerator.wait_for_checkpoint()
    params = torch.cat([p.detach().reshape(-1) for p in accelerator.unwrap_model(model).parameters()])
    names = _names(_s3(), f"{url}/checkpoints") if accelerator.is_main_process else None
    return resumed, losses, params, names


@pytest.mark.distributed
def test_two_processes_save_rotate_and_resume_bitwise_on_s3(s3_endpoint, s3_url):
    straight = run_distributed(_train_on_s3, 2, f"{s3_url}-straight", None, 0, env=s3_endpoint)
    stopped = run_distributed(_train_on_s3, 2, s3_url, 7, 0, env=s3_endpoint)
    after = run_distributed(_train_on_s3, 2, s3_url, None, 123, env=s3_endpoint)  # other weights until loaded
    assert straight[0][3] == ["checkpoint_2", "checkpoint_3", "latest"]  # 4 saves, total_limit=2
    manifest = json.loads(_s3().cat_file(f"{s3_url}-straight/checkpoints/checkpoint_3/manifest.json"))
    assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors"} <= set(manifest["files"])
    assert after[0][3] == ["checkpoint_2", "checkpoint_3", "latest"]  # resumed at 2, saved 3 at step 8
    for rank in range(2):
        assert stopped[rank][1] == straight[rank][1][:7]
        resumed, losses, params, _ = after[rank]
        assert resumed == f"{s3_url}/checkpoints/checkpoint_2"  # saved at step 6; step 7 was lost
        assert losses == straight[rank][1][6:]
        assert torch.equal(params, straight[rank][2])


def test_a_writer_killed_mid_upload_leaves_the_previous_checkpoint(s3_endpoint, s3_url):
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "upload_and_die.py"), s3_url],
        capture_output=True,
        text=True,
        timeout=120,
        env={**cli_env(), **s3_endpoint},
        cwd=REPO,
    )
    assert result.returncode == -9, result.stderr
    root = f"{s3_url}/checkpoints"
    torn = _names(_s3(), f"{root}/checkpoint_1")
    assert len(torn) == 1 and "manifest.json" not in torn  # one file made it, the manifest never did
    accelerator, model, optimizer = _accelerator(s3_url, automatic_checkpoint_naming=True)
    with torch.no_grad():
        model.weight.fill_(7.0)
    with pytest.warns(
        UserWarning, match=rf"Skipped 1 newer.*using {root}/checkpoint_0: .*checkpoint_1 has no"
    ):
        assert accelerator.resume_from_latest_checkpoint() == f"{root}/checkpoint_0"
    assert model.weight.abs().max() < 7.0
    _step(accelerator, model, optimizer)
    assert accelerator.save_state() == f"{root}/checkpoint_1"  # the torn prefix is replaced whole
    assert _names(_s3(), f"{root}/checkpoint_1") == [
        "accelerator_state.json",
        "manifest.json",
        "model.safetensors",
        "optimizer.bin",
        "random_states_0.pkl",
    ]


@pytest.mark.distributed
def test_a_rank_killed_inside_its_upload_leaves_no_manifest_however_long_rank_0_lives(s3_endpoint, s3_url):
    """tests/scripts/upload_and_die_on_rank_1.py: 2 processes, rank 1 SIGKILLed inside the upload of a
    background save before any of its files arrived; rank 0 lives on and looks for the markers after rank 1
    died. Rank 1 wrote no done marker (it writes it only once its files are uploaded), so rank 0 never
    writes the manifest and checkpoint_0 stays the newest valid one."""
    script = str(SCRIPTS / "upload_and_die_on_rank_1.py")
    with held_store(2) as store:  # the test holds the store's port, the ranks join it
        ranks = [
            subprocess.Popen(
                [sys.executable, script, s3_url],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=REPO,
                env=cli_env(
                    **s3_endpoint,
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE="2",
                    LOCAL_WORLD_SIZE="2",
                    **store,
                    OMP_NUM_THREADS="1",
                ),
            )
            for rank in range(2)
        ]
        (out0, err0), (_, err1) = (rank.communicate(timeout=scaled(120)) for rank in ranks)
    assert ranks[1].returncode == -9, err1[-3000:]
    assert ranks[0].returncode == 0, err0[-3000:]
    root = f"{s3_url}/checkpoints"
    assert out0.splitlines()[-1] == (
        "RuntimeError: The previous asynchronous checkpoint save failed: ranks [1] did not finish uploading "
        f"{root}/checkpoint_1 within 0 s"
    )
    assert _names(_s3(), f"{root}/checkpoint_1") == [  # rank 0's part; nothing of rank 1's, no manifest
        ".rank_0.done",
        "accelerator_state.json",
        "grads_0.safetensors",
        "model.safetensors",
        "optimizer.bin",
        "random_states_0.pkl",
    ]
    with pytest.warns(
        UserWarning, match=rf"Skipped 1 newer.*using {root}/checkpoint_0: .*checkpoint_1 has no manifest"
    ):
        assert storage_for(root).newest_valid(root) == f"{root}/checkpoint_0"


def test_an_async_save_uploads_in_the_background(s3_url):
    accelerator = Accelerator(project_dir=s3_url)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])  # 16 MB, and 16 MB of momentum
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    _step_wide = lambda: (accelerator.backward(model(torch.ones(2, 1024)).sum()), optimizer.step())  # noqa: E731
    _step_wide()
    accelerator.save_state(f"{s3_url}/sync")
    synchronous = accelerator.last_save_report.stall_seconds
    stalls = []  # the best of three: one stall on a loaded machine once took 0.50 s (sync: 0.57 s)
    for attempt in range(3):
        accelerator.save_state(f"{s3_url}/async{attempt}", async_save=True)
        stalls.append(accelerator.last_save_report.stall_seconds)
        _step_wide()  # training goes on while the upload runs
        accelerator.wait_for_checkpoint()
    asynchronous = min(stalls)
    print(f"stall: synchronous {synchronous:.3f} s, asynchronous {stalls}")
    assert asynchronous < synchronous / 2, (synchronous, stalls)
    accelerator.load_state(f"{s3_url}/async2")  # committed and verified


def _probe_error(url: str, **env) -> tuple[BaseException, float]:
    import s3fs

    saved = {key: os.environ.get(key) for key in env}
    for key, value in env.items():
        os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
    started = time.monotonic()
    try:
        with pytest.raises(OSError) as caught:
            Accelerator(project_dir=url)  # checked here, before any training
        return caught.value, time.monotonic() - started
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        s3fs.S3FileSystem.clear_instance_cache()


def test_a_missing_bucket_fails_before_training(s3_endpoint):
    error, seconds = _probe_error("s3://no-such-bucket/run")
    assert isinstance(error, FileNotFoundError)
    assert "Checkpoint storage 's3://no-such-bucket/run': the bucket 'no-such-bucket' does not exist" in str(
        error
    )
    assert seconds < 10


def test_missing_credentials_fail_before_training(s3_endpoint, tmp_path):
    error, seconds = _probe_error(
        "s3://lockstep-bucket/run",
        AWS_ACCESS_KEY_ID=None,
        AWS_SECRET_ACCESS_KEY=None,
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
        AWS_CONFIG_FILE=str(tmp_path / "none"),
    )
    assert isinstance(error, PermissionError)
    assert "found no credentials. Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in str(error)
    assert seconds < 10


@contextlib.contextmanager
def _refusing_endpoint() -> Iterator[str]:
    """An endpoint URL on a loopback port that refuses connections while inside: the port is bound and not
    listening, so nothing else takes it. Its number starts with 403, as an HTTP status that forbids."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        for port in range(40300, 40400):
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            yield f"http://127.0.0.1:{port}"
            return
        pytest.skip("no loopback port from 40300 to 40399 is free")


def test_an_unreachable_endpoint_fails_before_training(s3_endpoint):
    with _refusing_endpoint() as dead:
        error, seconds = _probe_error("s3://lockstep-bucket/run", AWS_ENDPOINT_URL=dead)
    assert isinstance(error, ConnectionError)
    assert "is unreachable. Check the endpoint (AWS_ENDPOINT_URL" in str(error)
    assert dead in str(error)
    assert seconds < 20


def test_an_endpoint_whose_port_reads_like_a_status_code_is_still_unreachable():
    botocore = pytest.importorskip("botocore.exceptions")
    from lockstep.checkpoint.storage.fsspec_store import describe_failure

    error = botocore.EndpointConnectionError(endpoint_url="http://127.0.0.1:40312/lockstep-bucket")
    assert isinstance(describe_failure("s3://b/run", error, 1.0), ConnectionError)
    denied = botocore.ClientError({"Error": {"Code": "403", "Message": "Forbidden"}}, "HeadObject")
    assert isinstance(describe_failure("s3://b/run", denied, 1.0), PermissionError)


class _CountingFilesystem:
    """An fsspec file system that records the objects this process opens or downloads."""

    def __init__(self, filesystem, touched: list) -> None:
        self._filesystem, self._touched = filesystem, touched

    def __getattr__(self, name: str):
        return getattr(self._filesystem, name)

    def open(self, path, *args, **kwargs):
        stream = self._filesystem.open(path, *args, **kwargs)
        entry = ["open", self._filesystem._strip_protocol(path), 0]
        self._touched.append(entry)
        close = stream.close

        def counting_close() -> None:  # the bytes its cache fetched from the store
            if getattr(stream, "cache", None) is not None:
                entry[2] = stream.cache.total_requested_bytes
            close()

        stream.close = counting_close
        return stream

    def get(self, rpaths, lpaths, *args, **kwargs):
        self._touched += [["get", self._filesystem._strip_protocol(p), None] for p in rpaths]
        return self._filesystem.get(rpaths, lpaths, *args, **kwargs)


def _load_counting(world: int, url: str) -> tuple[dict, dict[tuple[str, str], int]]:
    """Load the sharded checkpoint at ``url``; returns what was loaded, and the bytes this process fetched
    from the store per (``"get"`` or ``"open"``, file name under the checkpoint)."""
    from tests.backends.test_fsdp_checkpoint import _load

    touched: list = []
    load_filesystem = fsspec_store.load_filesystem
    fsspec_store.load_filesystem = lambda *a: _CountingFilesystem(load_filesystem(*a), touched)
    try:
        loaded = _load(world, url, "SHARDED_STATE_DICT")
    finally:
        fsspec_store.load_filesystem = load_filesystem
    prefix = _s3()._strip_protocol(url) + "/"
    sizes = {path.removeprefix(prefix): info["size"] for path, info in _s3().find(url, detail=True).items()}
    fetched: dict[tuple[str, str], int] = {}
    for how, path, counted in touched:  # an opened file's cache counts whole blocks: at most the file
        name = path.removeprefix(prefix)
        fetched[how, name] = fetched.get((how, name), 0) + min(sizes[name], counted or sizes[name])
    return loaded, fetched


@pytest.mark.distributed
def test_a_sharded_fsdp_checkpoint_round_trips_through_s3_each_process_reading_only_its_shards(
    s3_endpoint, s3_url
):
    from tests.backends.test_fsdp_checkpoint import _assert_same, _load, _save

    saved = run_distributed(_save, 2, 2, s3_url, "SHARDED_STATE_DICT", env=s3_endpoint)[0]
    names = _names(_s3(), s3_url)
    assert {"pytorch_model_fsdp_0", "optimizer_0", "manifest.json"} <= set(names)
    shards = [p for p in _s3().find(f"{s3_url}/pytorch_model_fsdp_0") if p.endswith(".distcp")]
    assert len(shards) == 2  # each process uploaded its own shard file from its own staging folder
    loaded = run_distributed(_load, 1, 1, s3_url, "SHARDED_STATE_DICT", env=s3_endpoint)[0]
    _assert_same(saved, loaded)  # on another world size
    prefix = _s3()._strip_protocol(s3_url) + "/"
    sizes = {
        path.removeprefix(prefix): info["size"] for path, info in _s3().find(s3_url, detail=True).items()
    }
    for rank, (loaded, fetched) in enumerate(run_distributed(_load_counting, 2, 2, s3_url, env=s3_endpoint)):
        _assert_same(saved, loaded)
        own = f"pytorch_model_fsdp_0/__{rank}_0.distcp"
        model = {key: n for key, n in fetched.items() if key[1].startswith("pytorch_model_fsdp_0/__")}
        assert model == {("get", own): sizes[own]}  # downloaded once, checksummed; the other's never opened
        optimizer = sorted(key for key in fetched if key[1].startswith("optimizer_0/__"))
        # the other rank's optimizer file is read in place for the values DCP stored once (each `step`)
        assert optimizer == [
            ("get", f"optimizer_0/__{rank}_0.distcp"),
            ("open", f"optimizer_0/__{1 - rank}_0.distcp"),
        ]


def _trainer(output_dir: str, seed: int, **options):
    from lockstep import Trainer, TrainingArguments
    from tests.helpers.training import make_dataset, make_model

    def mse(outputs, labels, num_items_in_batch=None):
        return nn.functional.mse_loss(outputs, labels)

    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        max_steps=6,
        save_strategy="steps",
        save_steps=2,
        disable_tqdm=True,
        report_to="none",
        **options,
    )
    return Trainer(make_model(seed=seed), args, train_dataset=make_dataset(64), compute_loss_func=mse)


def test_the_trainer_checkpoints_rotates_and_resumes_on_s3(s3_url, capsys):
    from tests.helpers.training import flat_params

    first = _trainer(s3_url, 0, save_total_limit=2)
    first.train()
    assert _names(_s3(), s3_url) == ["checkpoint-4", "checkpoint-6"]
    _s3().rm_file(f"{s3_url}/checkpoint-6/manifest.json")  # a save killed mid-upload: skipped
    resumed = _trainer(s3_url, 1, save_total_limit=2)  # other weights until loaded
    resumed.train(resume_from_checkpoint=True)
    assert f"[train] resumed from {s3_url}/checkpoint-4 at step 4/6" in capsys.readouterr().out
    assert torch.equal(flat_params(resumed.model), flat_params(first.model))
    assert _names(_s3(), s3_url) == ["checkpoint-4", "checkpoint-6"]


def test_a_weights_only_trainer_checkpoint_on_memory_is_committed_and_refused_for_resuming(memory_url):
    _trainer(memory_url, 0, save_only_model=True, save_total_limit=1).train()
    filesystem = fsspec.filesystem("memory")
    assert _names(filesystem, memory_url) == ["checkpoint-6"]
    assert {"manifest.json", "model.safetensors", "trainer_state.json"} <= set(
        _names(filesystem, f"{memory_url}/checkpoint-6")
    )
    with pytest.raises(ValueError, match=r"checkpoint-6' was saved with save_only_model=True"):
        _trainer(memory_url, 0).train(resume_from_checkpoint=f"{memory_url}/checkpoint-6")


def test_the_trainers_final_files_go_under_the_url(memory_url, tmp_path, monkeypatch):
    from safetensors.torch import load

    monkeypatch.chdir(tmp_path)  # Path(url) would write them to the local folder memory:/... here
    trainer = _trainer(memory_url, 0, save_total_limit=1)
    trainer.train()
    trainer.save_model()
    trainer.save_metrics("train", {"train_loss": 1.0})
    trainer.save_metrics("eval", {"eval_loss": 2.0})  # merged into the uploaded all_results.json
    trainer.save_state()
    trainer.create_model_card(model_name="tiny")
    filesystem = fsspec.filesystem("memory")
    assert _names(filesystem, memory_url) == [
        "README.md",
        "all_results.json",
        "checkpoint-6",
        "eval_results.json",
        "model.safetensors",
        "train_results.json",
        "trainer_state.json",
        "training_args.json",
    ]
    assert json.loads(filesystem.cat(f"{memory_url}/all_results.json")) == {
        "eval_loss": 2.0,
        "train_loss": 1.0,
    }
    weights = load(filesystem.cat(f"{memory_url}/model.safetensors"))
    assert all(torch.equal(weights[name], value) for name, value in trainer.model.state_dict().items())
    assert json.loads(filesystem.cat(f"{memory_url}/trainer_state.json"))["global_step"] == 6
    assert list(tmp_path.iterdir()) == []


def test_a_hyperparameter_search_checkpoints_each_trial_under_the_url(memory_url, tmp_path, monkeypatch):
    pytest.importorskip("optuna")
    from lockstep import Trainer
    from tests.helpers.training import make_dataset, make_model

    monkeypatch.chdir(tmp_path)  # Path(url) / "run-0" would be the local folder memory:/.../run-0 here
    base = _trainer(memory_url, 0, save_total_limit=1)
    trainer = Trainer(
        args=base.args,
        model_init=lambda: make_model(seed=0),
        train_dataset=make_dataset(64),
        eval_dataset=make_dataset(8),
        compute_loss_func=base.compute_loss_func,
    )
    best = trainer.hyperparameter_search(
        hp_space=lambda trial: {"learning_rate": trial.suggest_float("learning_rate", 0.01, 0.1)},
        n_trials=1,
        backend="optuna",
    )
    assert best.run_id == "0"
    assert _names(fsspec.filesystem("memory"), f"{memory_url}/run-0") == ["checkpoint-6"]
    assert list(tmp_path.iterdir()) == []


def _load_from_a_dead_endpoint(url: str) -> tuple[str, str, float]:
    accelerator = Accelerator()  # a local project: the URL is met only here
    model = accelerator.prepare(nn.Linear(4, 2))
    started = time.monotonic()
    try:
        accelerator.load_state(url)
    except Exception as error:
        return type(error).__name__, str(error), time.monotonic() - started
    return "", repr(model), 0.0


@pytest.mark.distributed
def test_loading_from_a_dead_endpoint_fails_on_every_rank_instead_of_hanging(s3_endpoint):
    url = "s3://lockstep-bucket/run/checkpoints/checkpoint_0"
    with _refusing_endpoint() as dead:
        env = {**s3_endpoint, "AWS_ENDPOINT_URL": dead}
        results = run_distributed(_load_from_a_dead_endpoint, 2, url, env=env, timeout=60)
    assert results[0][:2] == results[1][:2]  # the main process's error, raised on both ranks
    assert results[0][0] == "ConnectionError"
    assert results[0][1].startswith(f"Checkpoint storage '{url}' is unreachable. Check the endpoint")
    assert all(seconds < 30 for _, _, seconds in results)
