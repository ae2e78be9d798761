"""The pure parts of bench/pipeline_vs_data_parallel.py (bench/_pipeline_figures.py): the configurations,
the bubble, the figures file's shape, the table and the chart. No process group is started: the rows are
written by hand, with the per-rank figures of a real run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("pipeline_figures", ROOT / "bench" / "_pipeline_figures.py")
figures_module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = figures_module  # dataclasses look their module up there
spec.loader.exec_module(figures_module)

STATE, HALF, QUARTER = 50_581_816, 25_290_000, 12_645_000


def rank(state: int, activations: int) -> dict:
    return {"model_state_bytes": state, "activation_peak_bytes": activations, "parameters": state // 16}


def sample_figures() -> dict:
    by_name = {config.name: config for config in figures_module.configurations()}
    rows = [
        figures_module.make_row(by_name["one process"], [20.0, 22.0, 30.0], [rank(STATE, 1_608_960)]),
        figures_module.make_row(by_name["DDP x2"], [40.0, 44.0], [rank(STATE, 804_480)] * 2),
        figures_module.make_row(by_name["FSDP x2"], [100.0], [rank(HALF, 804_480)] * 2),
        figures_module.make_row(
            by_name["pp=2 1F1B m=4"], [55.0, 55.0], [rank(HALF, 630_000), rank(HALF, 210_000)]
        ),
        figures_module.make_row(
            by_name["pp=2 x dp=2 1F1B m=4"],
            [176.0],
            [rank(QUARTER, 315_968)] * 2 + [rank(QUARTER, 102_672)] * 2,
        ),
    ]
    return figures_module.make_figures(
        date="2026-12-01",
        machine={"cpus": 2, "load_average": [5.04, 6.2]},
        settings={"rounds": 2, "steps": 20},
        rows=rows,
    )


def test_the_configurations_cover_the_issue_with_one_global_batch():
    configs = {config.name: config for config in figures_module.configurations()}
    assert list(configs)[:3] == ["one process", "DDP x2", "FSDP x2"]
    assert [name for name in configs if name.startswith("pp=2 GPipe")] == [
        "pp=2 GPipe m=4",
        "pp=2 GPipe m=8",
        "pp=2 GPipe m=16",
    ]
    assert configs["FSDP x2"].flags == ("--mode", "fsdp") and configs["FSDP x2"].processes == 2
    both = configs["pp=2 x dp=2 1F1B m=4"]
    assert both.processes == 4 and both.stages == 2 and both.flags[-2:] == ("--dp-shard", "2")
    assert configs["pp=2 1F1B m=16"].flags[-1] == "16" and configs["DDP x2"].microbatches is None


def test_bubbles_theory_and_measured():
    assert figures_module.theoretical_bubble(2, 4) == pytest.approx(0.2)
    assert figures_module.theoretical_bubble(2, 16) == pytest.approx(1 / 17)
    assert figures_module.theoretical_bubble(4, 1) == pytest.approx(0.75)
    # a perfect split of 20 ms over 2 processes is 10 ms: a 40 ms step is 75% not explained by it
    assert figures_module.measured_bubble(20.0, 40.0, 2) == pytest.approx(0.75)
    assert figures_module.measured_bubble(20.0, 5.0, 4) == pytest.approx(0.0)
    with pytest.raises(ValueError, match=r"theoretical_bubble\(stages=2, microbatches=0\) is invalid"):
        figures_module.theoretical_bubble(2, 0)
    with pytest.raises(ValueError, match=r"measured_bubble\(single_ms=20.0, step_ms=0.0\) is invalid"):
        figures_module.measured_bubble(20.0, 0.0, 2)


def test_figures_fill_the_bubble_of_pipelined_rows_only_and_survive_json():
    figures = sample_figures()
    rows = {row["name"]: row for row in figures["rows"]}
    assert rows["one process"]["step_ms"] == 22.0  # the median of the rounds
    assert rows["DDP x2"]["bubble"] is None and rows["FSDP x2"]["bubble"] is None
    assert rows["pp=2 1F1B m=4"]["bubble"] == pytest.approx({"measured": 0.8, "theory": 0.2})
    # pp x dp: one process's 22 ms over 4 processes is 5.5 ms of a 176 ms step
    assert rows["pp=2 x dp=2 1F1B m=4"]["bubble"]["measured"] == pytest.approx(1 - 5.5 / 176)
    assert [r["model_state_bytes"] for r in rows["pp=2 x dp=2 1F1B m=4"]["ranks"]] == [QUARTER] * 4
    again = json.loads(json.dumps(figures))
    figures_module.validate(again)
    assert again == figures


def test_validate_names_each_departure():
    figures = sample_figures()
    figures["schema"] = "other/1"
    figures["rows"][1]["ranks"] = figures["rows"][1]["ranks"][:1]
    figures["rows"][2]["bubble"] = {"measured": 0.5, "theory": 0.2}
    del figures["rows"][3]["ranks"][1]["activation_peak_bytes"]
    with pytest.raises(ValueError) as raised:
        figures_module.validate(figures)
    message = str(raised.value)
    assert "schema is 'other/1'" in message
    assert "rows[1] (DDP x2) has 1 ranks for 2 processes" in message
    assert "rows[2] (FSDP x2): a bubble belongs to pipelined rows only" in message
    assert "rows[3].ranks[1] lacks ['activation_peak_bytes']" in message
    with pytest.raises(ValueError, match=r"make_row\('DDP x2'\): 1 ranks reported, expected 2"):
        figures_module.make_row(figures_module.configurations()[1], [1.0], [rank(STATE, 1)])
    with pytest.raises(ValueError, match=r"make_figures\(\) needs a one-process row, among \['DDP x2'\]"):
        figures_module.make_figures(date="d", machine={}, settings={}, rows=[figures["rows"][1]])


def test_table_has_one_line_per_configuration_with_per_rank_figures():
    lines = figures_module.format_table(sample_figures()).splitlines()
    assert len(lines) == 2 + 5
    assert lines[2] == "| one process | 1 | 22.0 | 48.2 | 1.53 |  |"
    assert lines[4] == "| FSDP x2 | 2 | 100.0 | 24.1 / 24.1 | 0.77 / 0.77 |  |"
    assert lines[5] == "| pp=2 1F1B m=4 | 2 | 55.0 | 24.1 / 24.1 | 0.60 / 0.20 | 0.80 / 0.20 |"
    assert lines[6].startswith(
        "| pp=2 x dp=2 1F1B m=4 | 4 | 176.0 | 12.1 / 12.1 / 12.1 / 12.1 | 0.30 / 0.30 / "
    )


def test_chart_is_one_small_png_and_refuses_bad_figures(tmp_path):
    pytest.importorskip("matplotlib")
    path = figures_module.write_chart(sample_figures(), tmp_path / "sub" / "chart.png")
    assert path == tmp_path / "sub" / "chart.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 10_000 < path.stat().st_size < 200_000
    broken = sample_figures()
    broken["rows"][0]["bubble"] = {"measured": 0.1, "theory": 0.1}
    with pytest.raises(ValueError, match=r"a bubble belongs to pipelined rows only"):
        figures_module.write_chart(broken, tmp_path / "broken.png")
    assert not (tmp_path / "broken.png").exists()


def test_the_committed_figures_follow_the_schema():
    results = sorted((ROOT / "bench" / "results").glob("pipeline-vs-data-parallel-*.json"))
    if not results:
        pytest.skip("no bench/results/pipeline-vs-data-parallel-*.json committed yet")
    for path in results:
        figures = json.loads(path.read_text())
        figures_module.validate(figures)
        assert path.with_suffix(".png").exists()
