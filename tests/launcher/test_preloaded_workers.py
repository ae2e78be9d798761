"""Workers forked from the launcher's preloaded server (``LOCKSTEP_PRELOAD_WORKERS=1``) behave as the fresh
interpreters they replace."""

from __future__ import annotations

import json
import os
import re
import select
import time
from pathlib import Path

import pytest

from lockstep.launcher import preloaded
from tests.helpers.cli import SCRIPTS, cli_env, lockstep, lockstep_popen
from tests.helpers.deadlines import scaled

pytestmark = pytest.mark.distributed


def _launch_and_read_facts(out: Path, **env: str) -> list[dict]:
    """Each rank's facts, read while the workers still run (their output is not held in a buffer),
    then the workers are let go and the exit handlers' markers are read."""
    environment = cli_env(**env)
    environment.pop("PYTHONUNBUFFERED", None)  # the launch, not the environment, sends each line at once
    launcher = lockstep_popen(
        "launch", "--num-processes", "2", str(SCRIPTS / "worker_facts.py"), str(out), env=environment
    )
    text = ""  # two workers share the pipe; a read may end inside a line
    deadline = time.monotonic() + scaled(90)  # the workers wait for go up to 300 s
    assert launcher.stdout is not None
    while len(_records("FACTS", text)) < 2 and time.monotonic() < deadline and launcher.poll() is None:
        if select.select([launcher.stdout], [], [], 1.0)[0]:
            text += os.read(launcher.stdout.fileno(), 65536).decode()
    facts = _records("FACTS", text)
    (out / "go").write_text("")
    stdout, stderr = launcher.communicate(timeout=scaled(120))
    assert launcher.returncode == 0, stderr
    assert len(facts) == 2, f"the workers' lines did not arrive while they ran: {facts}\n{stderr}"
    draws = {d["rank"]: d["draw"] for d in _records("NUMPY", text + stdout)}
    for fact in facts:
        fact["numpy_draw"] = draws[fact["rank"]]
    return sorted(facts, key=lambda f: f["rank"])


def _records(tag: str, text: str) -> list[dict]:
    return [json.loads(found) for found in re.findall(tag + r" (\{[^{}]*\})", text)]


@pytest.mark.parametrize("fresh", [False, True], ids=["preloaded", "fresh-interpreters"])
def test_a_worker_runs_the_script_as_a_fresh_interpreter_would(tmp_path, fresh):
    env = {} if fresh else {preloaded.PRELOAD_WORKERS: "1"}
    facts = _launch_and_read_facts(tmp_path, **env)
    # unseeded generators differ between workers, as between fresh interpreters
    assert facts[0]["python_random"] != facts[1]["python_random"]
    assert facts[0]["numpy_draw"] != facts[1]["numpy_draw"]
    for rank, fact in enumerate(facts):
        assert fact["torch_preloaded"] is not fresh  # what the server imported once, for every worker
        assert fact["session_leader"], "a worker leads a session of its own, as torch's agent starts them"
        assert fact["argv"] == [str(tmp_path)] and fact["main"] == "__main__"
        # the non-daemon thread ended before the exit handlers ran, and the handlers ran at all
        assert (tmp_path / f"atexit_{rank}").read_text() == "True"


@pytest.mark.parametrize("code", [0, 3])
def test_a_script_that_ends_with_os_exit_ends_the_launch_with_its_code(code):
    """torch's agent waits for a forked worker's return value, which ``os._exit`` skips: it waited forever."""
    done = lockstep(
        "launch",
        "--num-processes",
        "2",
        str(SCRIPTS / "os_exit.py"),
        str(code),
        timeout=120,
        env=cli_env(**{preloaded.PRELOAD_WORKERS: "1"}),
    )
    assert (done.returncode == 0) is (code == 0), done.stderr
    if code == 0:
        assert done.stdout.count(f"leaving with {code}") == 2, done.stderr
    else:  # the first worker to fail ends the launch: the other may be stopped before it prints
        assert done.stdout.count(f"leaving with {code}") >= 1, done.stderr
        assert re.search(rf"rank \d \(local rank \d, pid \d+\) exited with code {code}", done.stderr), (
            done.stderr
        )


def test_a_second_launch_with_another_environment_gets_fresh_interpreters(monkeypatch):
    monkeypatch.setenv(preloaded.PRELOAD_WORKERS, "1")
    monkeypatch.setattr(preloaded, "_server_environment", None)
    assert preloaded.can_preload()
    monkeypatch.setattr(preloaded, "_server_environment", dict(os.environ))
    assert preloaded.can_preload()  # the server's environment is this one: reuse it
    monkeypatch.setenv("LOCKSTEP_SOMETHING_NEW", "1")
    assert not preloaded.can_preload()  # the server would hand workers a stale environment
    monkeypatch.setattr(preloaded, "_server_environment", None)
    monkeypatch.delenv(preloaded.PRELOAD_WORKERS)
    assert not preloaded.can_preload()  # off unless asked for


def _script(tmp_path: Path, source: str) -> str:
    path = tmp_path / "train.py"
    path.write_text(source)
    return str(path)


def test_the_server_preloads_the_libraries_a_script_imports_at_its_top(tmp_path):
    source = "import os\nimport torch\nrank = int(os.environ['RANK'])\ntry:\n    import numpy\nexcept ImportError:\n    pass\n"
    modules = preloaded.libraries_to_preload(_script(tmp_path, source + "def f():\n    import safetensors\n"))
    assert modules[: len(preloaded.BASE_MODULES)] == list(preloaded.BASE_MODULES)
    assert modules[len(preloaded.BASE_MODULES) :] == ["numpy"]  # not safetensors: only inside a function
    assert preloaded.libraries_to_preload("json", module=True) == []  # a module without torch


@pytest.mark.parametrize(
    "source",
    [
        "import os\n",  # no library worth preloading: fresh interpreters cost nothing more
        "import os\nos.environ['HF_HOME'] = '/data'\nimport torch\n",
        "import os\nos.environ.setdefault('TORCH_LOGS', 'dynamo')\nimport torch\n",
        "from os import environ, putenv\nputenv('A', '1')\nimport torch\n",
        "import os\nif True:\n    del os.environ['A']\nimport torch\n",
        "import torch\ndef broken(:\n",
    ],
    ids=["no-torch", "environ-set", "setdefault", "putenv", "del", "syntax-error"],
)
def test_scripts_that_write_the_environment_at_their_top_get_fresh_interpreters(tmp_path, source):
    assert preloaded.libraries_to_preload(_script(tmp_path, source)) == []


GC_FACTS = """
import gc
import json
import os

import torch


def private_dirty_kib() -> int:
    with open("/proc/self/smaps_rollup") as smaps:
        return sum(int(line.split()[1]) for line in smaps if line.startswith("Private_Dirty:"))


before = private_dirty_kib()
gc.collect()
facts = {"rank": int(os.environ["RANK"]), "dirtied_kib": private_dirty_kib() - before}
facts.update(frozen=gc.get_freeze_count(), tracked=len(gc.get_objects()))
print("GCFACTS " + json.dumps(facts))
"""


@pytest.mark.skipif(
    not Path("/proc/self/smaps_rollup").exists(), reason="reads Linux's /proc/self/smaps_rollup"
)
def test_a_full_collection_in_a_forked_worker_leaves_the_servers_pages_shared(tmp_path):
    """A full collection that walks the objects inherited from the server writes to each one's collector
    header, copying their pages out of the memory the workers share: 61,128 KiB per worker before they
    were frozen at the fork, 92 KiB after."""
    done = lockstep(
        "launch",
        "--num-processes",
        "2",
        _script(tmp_path, GC_FACTS),
        timeout=120,
        env=cli_env(**{preloaded.PRELOAD_WORKERS: "1"}),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    facts = _records("GCFACTS", done.stdout)
    assert len(facts) == 2, done.stdout
    for fact in facts:
        assert fact["frozen"] > 100_000  # what the server imported: torch, torch._dynamo, lockstep
        assert fact["tracked"] < 50_000  # what a collection walks: the worker's own objects
        assert fact["dirtied_kib"] < 2048, fact
