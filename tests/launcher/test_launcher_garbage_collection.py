"""The launcher imports torch outside the cyclic garbage collector's reach: no full collection of the
launcher walks torch's objects, during the launch or later in a run it supervises."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

from lockstep.launcher.elastic import imported_outside_garbage_collection
from tests.helpers.cli import REPO, cli_env

# A launcher whose full collections are counted, with the objects each one had to walk.
COUNTED_LAUNCH = """
import gc, json, sys
walked = []
def count(phase, info):
    if phase == "start" and info["generation"] == 2:
        walked.append(len(gc.get_objects(generation=2)))
gc.callbacks.append(count)
from lockstep.cli.main import main
code = main(["launch", "--num-processes", "2", sys.argv[1]])
print("COLLECTIONS " + json.dumps({"code": code, "walked": walked, "frozen": gc.get_freeze_count()}))
"""


def test_no_full_collection_of_a_launch_walks_torchs_objects(tmp_path: Path) -> None:
    """Before: three full collections during torch's import (11, 29 and about 50 ms, the last walking
    about 250,000 objects), where torchrun's start-up met two."""
    script = tmp_path / "noop.py"
    script.write_text("print('started')\n")
    result = subprocess.run(
        [sys.executable, "-c", COUNTED_LAUNCH, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=cli_env(),
        cwd=REPO,
    )
    line = next(line for line in result.stdout.splitlines() if line.startswith("COLLECTIONS "))
    counted = json.loads(line.split(" ", 1)[1])
    assert counted["code"] == 0, result.stderr[-3000:]
    assert counted["frozen"] > 100_000  # torch's modules, functions and tables
    assert all(walked < 20_000 for walked in counted["walked"]), counted["walked"]


def test_the_collector_is_paused_for_the_imports_and_resumed_as_it_was() -> None:
    frozen = gc.get_freeze_count()
    try:
        assert gc.isenabled()
        with imported_outside_garbage_collection():
            assert not gc.isenabled()
            kept = [[index] for index in range(1000)]
        assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(kept)
        gc.disable()
        with imported_outside_garbage_collection():
            pass
        assert not gc.isenabled()  # a caller's choice is kept
    finally:
        gc.enable()
        gc.unfreeze()
