"""The peers benchmark's pure parts (bench/peers/harness.py): ABBA order, ratios and their spread, the
result schema, the equal-work check, the table and the charts (none of this needs the peers' environment),
and a quick run end to end in bench/peers/.venv (``make test`` builds it; without it the run is skipped, and
fails under CI=true)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "bench" / "peers"
spec = importlib.util.spec_from_file_location("peers_harness", PEERS / "harness.py")
harness = importlib.util.module_from_spec(spec)
spec.loader.exec_module(harness)


def sample_result() -> dict:
    step = harness.measure(
        "DDP step",
        "ms",
        {
            "torch": [10.0, 12.0, 11.0, 10.0],
            "lockstep": [10.0, 12.6, 11.0, 10.5],
            "fabric": [11.0, 12.0, 12.1, 11.0],
        },
        load_average=[1.234, 2.0],
        notes={"fabric": "a note"},
        extra={"flags": {"fabric": "not sharded: DDP"}},
    )
    imports = harness.measure(
        "import", "s", {"torch": [1.0, 1.2], "lockstep": [1.05, 1.2]}, kind="delta", load_average=[1, 1]
    )
    return harness.make_result(
        date="2026-12-01",
        machine={"cpus": 2},
        versions={"torch": "2.13.0"},
        settings={"size": "quick"},
        measures={"ddp": step, "import": imports},
        checks={},
    )


def test_abba_order_reverses_every_other_block():
    assert harness.abba_order(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    # over two blocks every tool sits at every distance from the start equally
    positions = {
        t: sum(order.index(t) for order in harness.abba_order(harness.TOOLS, 2)) for t in harness.TOOLS
    }
    assert set(positions.values()) == {3}
    with pytest.raises(ValueError, match=r"abba_order\(blocks=0\) is invalid"):
        harness.abba_order(["a"], 0)


def test_summarize_takes_the_median_of_per_block_ratios():
    summary = harness.summarize({"torch": [10.0, 20.0, 10.0], "x": [11.0, 20.0, 12.0]})
    assert summary["torch"]["ratio"] == 1.0
    assert summary["x"]["ratio"] == pytest.approx(1.1)  # blocks 1.1, 1.0, 1.2
    assert (summary["x"]["min"], summary["x"]["max"]) == (pytest.approx(1.0), pytest.approx(1.2))
    assert summary["x"]["q1"] == pytest.approx(1.05) and summary["x"]["q3"] == pytest.approx(1.15)
    assert summary["x"]["median"] == 12.0 and summary["x"]["samples"] == [11.0, 20.0, 12.0]
    delta = harness.summarize({"torch": [1.0, 2.0], "x": [1.5, 2.1]}, kind="delta")
    assert delta["x"]["delta"] == pytest.approx(0.3)


def test_summarize_refuses_blocks_not_run_side_by_side():
    with pytest.raises(ValueError, match="x has 1 blocks and torch 2"):
        harness.summarize({"torch": [1.0, 2.0], "x": [1.0]})
    with pytest.raises(ValueError, match="needs the baseline 'torch'"):
        harness.summarize({"x": [1.0]})
    with pytest.raises(ValueError, match="kind='speed'"):
        harness.summarize({"torch": [1.0]}, kind="speed")


def test_result_schema_round_trips_and_names_every_problem():
    result = sample_result()
    assert json.loads(json.dumps(result)) == result
    assert result["measures"]["ddp"]["load_average"] == [1.23, 2.0]
    assert result["measures"]["ddp"]["tools"]["lockstep"]["ratio"] == pytest.approx(1.025)
    broken = json.loads(json.dumps(result))
    broken["schema"] = "other/0"
    del broken["measures"]["ddp"]["tools"]["torch"]
    broken["measures"]["import"]["tools"]["lockstep"].pop("delta")
    with pytest.raises(ValueError) as error:
        harness.validate(broken)
    message = str(error.value)
    assert "schema is 'other/0'" in message
    assert "measures.ddp.tools has no 'torch' baseline" in message
    assert "measures.import.tools.lockstep.delta is missing" in message


def test_equal_work_holds_steps_and_loss_to_the_tolerance():
    runs = {
        "torch": {"steps": 20, "final_loss": 2.0},
        "lockstep": {"steps": 20, "final_loss": 2.0 + 5e-6},
        "fabric": {"steps": 20, "final_loss": 2.0 + 2e-5},
    }
    check = harness.equal_work(runs)
    assert not check["ok"]
    assert check["tools"]["lockstep"]["ok"] and not check["tools"]["fabric"]["ok"]
    assert check["tools"]["fabric"]["loss_diff"] == pytest.approx(2e-5)
    # a different data order is reported, not held to the tolerance; a missing step always fails
    runs["fabric"]["same_order"] = False
    assert harness.equal_work(runs)["ok"]
    runs["lockstep"]["steps"] = 19
    assert not harness.equal_work(runs)["tools"]["lockstep"]["ok"]


def test_table_shows_ratios_with_quartiles_and_load():
    table = harness.format_table(sample_result(), tools=["torch", "lockstep", "fabric"])
    lines = table.splitlines()
    assert lines[0] == "| measure | hand-written PyTorch | lockstep | Lightning Fabric | load avg |"
    assert lines[2].startswith("| DDP step | 1.000 (1.00-1.00) | 1.025 (")
    assert lines[2].endswith("| 1.2/2.0 |")
    assert lines[2].endswith("| 1.100 (1.07-1.10) [not sharded: DDP] | 1.2/2.0 |")
    assert "| import | +0.00 s | +0.03 s | n/a |" in table


def test_charts_are_one_small_png_per_measure(tmp_path):
    pytest.importorskip("matplotlib")
    paths = harness.write_charts(sample_result(), tmp_path, "peers-test")
    assert [p.name for p in paths] == ["peers-test-ddp.png", "peers-test-import.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size < 100_000


def test_the_committed_results_follow_the_schema():
    results = sorted((ROOT / "bench" / "results").glob("peers-*.json"))
    if not results:
        pytest.skip("no bench/results/peers-*.json committed yet")
    for path in results:
        harness.validate(json.loads(path.read_text()))


PEERS_PYTHON = PEERS / ".venv" / "bin" / "python"


MEASURES = {
    "import",
    "launch",
    "ddp_mlp",
    "ddp_transformer",
    "fsdp",
    "checkpoint_save",
    "checkpoint_load",
    "async_stall",
    "resume_10",
    "resume_100000",
}


@pytest.fixture(scope="module")
def quick_result(tmp_path_factory) -> dict:
    """``bench/peers/run --quick`` end to end (about 220 CPU-s, mostly one process at a time), against the real
    Accelerate and Lightning Fabric in bench/peers/.venv, which ``make test`` builds: a broken worker, a
    renamed helper or a peer's release that breaks the harness fails CI, not the next person who runs the
    table. Only what does not depend on the machine's load is checked; a quick run's timings are not
    figures."""
    if not PEERS_PYTHON.exists():
        if os.environ.get("CI") == "true":
            pytest.fail("bench/peers/.venv is missing: make test builds it (bash bench/peers/setup.sh)")
        pytest.skip("needs the peers' environment (bash bench/peers/setup.sh)")
    out = tmp_path_factory.mktemp("peers")
    command = [str(PEERS / "run"), "--quick", "--out", str(out), "--date", "2000-01-01"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert completed.returncode == 0, (completed.stdout[-3000:], completed.stderr[-3000:])
    result = json.loads((out / "peers-2000-01-01-quick.json").read_text())
    harness.validate(result)
    assert len(list(out.glob("*.png"))) == len(result["measures"])
    return result


@pytest.mark.slow
def test_the_quick_run_has_every_measure_for_every_tool(quick_result):
    assert set(quick_result["measures"]) == MEASURES
    for name, entry in quick_result["measures"].items():
        # Accelerate and Fabric have no asynchronous save
        expected = {"torch", "lockstep"} if name == "async_stall" else set(harness.TOOLS)
        assert set(entry["tools"]) == expected, name
        assert all(figures["median"] > 0 for figures in entry["tools"].values()), name


@pytest.mark.slow
def test_the_quick_run_gives_every_tool_equal_work(quick_result):
    for workload, check in quick_result["checks"]["equal_work"].items():
        assert check["timed_steps_equal"], (workload, check["timed_optimizer_steps"])
        assert check["in_order"]["ok"] and check["shuffled"]["ok"], workload


@pytest.mark.slow
def test_the_quick_run_resumes_lockstep_and_the_hand_written_loop_exactly(quick_result):
    tools = quick_result["checks"]["resume_correctness"]["tools"]
    assert tools["torch"]["weights_equal"] and tools["lockstep"]["weights_equal"], tools
    assert tools["lockstep"]["max_abs_diff"] == 0.0


def test_the_docstring_examples_hold():
    import doctest

    failures, tried = doctest.testmod(harness)
    assert (failures, tried) == (0, 2)


def _run_module():
    run_spec = importlib.util.spec_from_file_location("peers_run", PEERS / "run.py")
    module = importlib.util.module_from_spec(run_spec)
    run_spec.loader.exec_module(module)
    return module


def test_only_refuses_unknown_groups_by_name():
    run = _run_module()
    assert run.parse_groups("checkpoints, resume") == ("checkpoints", "resume")
    with pytest.raises(SystemExit, match=r"names \['ckpt'\]; the groups are import, launch, steps"):
        run.parse_groups("ckpt,resume")


def test_only_replaces_the_named_entries_and_keeps_the_others(tmp_path):
    run = _run_module()
    path = tmp_path / "peers-2026-12-01.json"
    with pytest.raises(SystemExit, match="does not exist; run all first"):
        run.merged_into(path, {}, {}, {})
    original = sample_result()
    path.write_text(json.dumps(original))
    again = harness.measure(
        "DDP step", "ms", {"torch": [9.0, 9.0], "lockstep": [9.0, 9.9]}, load_average=[3, 3]
    )
    merged = run.merged_into(
        path, {"ddp": again}, {"resume_correctness": {"tools": {}}}, original["versions"]
    )
    assert merged["measures"]["ddp"]["tools"]["lockstep"]["ratio"] == pytest.approx(1.05)
    assert merged["measures"]["import"] == json.loads(json.dumps(original["measures"]["import"]))
    assert merged["checks"]["resume_correctness"] == {"tools": {}}
    assert set(merged["machine"]["remeasured"]) == {"ddp"}
    with pytest.raises(SystemExit, match="measure everything again instead of mixing them"):
        run.merged_into(path, {"ddp": again}, {}, {"torch": "0.0"})
