"""``lockstep report``: summary and PNG plots from the jsonl logs of a real 2-process training run."""

from __future__ import annotations

import json
import struct
import sys

import pytest
import torch

from lockstep import Accelerator, ThroughputKwargs
from lockstep.report import read_run, summarize
from tests.helpers.cli import lockstep
from tests.helpers.multiprocess import run_distributed
from tests.helpers.optional import requires
from tests.helpers.training import loader, loss_fn, make_model

STEPS = 40


def _train_and_log(project_dir: str) -> None:
    # Throughput figures every 2nd step (averages of the 2 steps), as the accounting logs them.
    accelerator = Accelerator(
        log_with="jsonl", project_dir=project_dir, kwargs_handlers=[ThroughputKwargs(log_every_n_steps=2)]
    )
    accelerator.init_trackers("regression", config={"lr": 0.05})
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / (2 * STEPS))
    model, optimizer, train_dl = accelerator.prepare(model, optimizer, loader(STEPS * 8, 4))
    for step, batch in enumerate(train_dl, start=1):
        loss = loss_fn(model, batch)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.item(), "lr": scheduler.get_last_lr()[0]}, step=step)
        if step % 10 == 0:
            accelerator.log({"eval_loss": loss.item() * 1.1}, step=step)
    accelerator.end_training()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    project = tmp_path_factory.mktemp("report")
    run_distributed(_train_and_log, 2, str(project), timeout=120)
    return project / "regression"


def _png_size(path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", header[16:24])


@pytest.mark.distributed
def test_summary_of_a_real_run(run_dir):
    run = read_run(run_dir / "metrics.jsonl")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [record["loss"] for record in lines if "loss" in record]
    assert len(losses) == STEPS and len(run.series["loss"]) == STEPS
    assert run.series["time/step"].steps == [float(s) for s in range(2, STEPS + 1, 2)]
    assert len(run.series["samples_per_second"]) == STEPS // 2
    summary = "\n".join(summarize(run))
    best = min(losses)
    assert (
        f"loss: best {best:.4g} at step {losses.index(best) + 1}, last {losses[-1]:.4g} at step {STEPS}"
        in summary
    )
    assert f"{STEPS} steps (1 to {STEPS})" in summary
    assert "lr: 0.04938 -> 0.025 (max 0.04938)" in summary  # logged after scheduler.step()
    assert "eval_loss: best" in summary
    assert "samples/s: median" in summary and f"over {STEPS // 2} logged values" in summary
    where = next(line for line in summary.splitlines() if "where time went" in line)
    total = sum(2 * seconds for seconds in run.series["time/step"].values)  # each record: mean of 2 steps
    assert f"where time went ({total:.1f} s in {STEPS} steps, median logged step time" in where
    for phase in ("data", "forward_backward", "optimizer", "other"):
        assert f"{phase} " in where
    shares = [float(part.split()[-1].rstrip("%")) for part in where.split(": ", 1)[1].split(", ")]
    assert sum(shares) == pytest.approx(100, abs=0.5)  # the phases tile the step


@pytest.mark.distributed
@requires("matplotlib")
def test_cli_writes_readable_pngs_and_prints_the_summary(run_dir, tmp_path):
    result = lockstep("report", str(run_dir), "--output", str(tmp_path / "plots"))
    assert result.returncode == 0, result.stderr
    assert "Run regression" in result.stdout and "where time went" in result.stdout
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["learning_rate.png", "loss.png", "step_time.png", "throughput.png"]
    for name in names:
        width, height = _png_size(tmp_path / "plots" / name)
        assert width >= 800 and height >= 350, (name, width, height)
    # the parent logging folder works too: every run below it, plots next to each run by default
    parent = lockstep("report", str(run_dir.parent), "--no-plots")
    assert parent.returncode == 0 and "Run regression" in parent.stdout and "plots:" not in parent.stdout


def test_cut_short_log_and_errors(tmp_path):
    run = tmp_path / "crashed"
    run.mkdir()
    records = [{"step": s, "time": 100.0 + s, "loss": 1.0 / s, "note": "text"} for s in range(1, 4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 4, "lo')
    summary = summarize(read_run(run / "metrics.jsonl"))
    assert summary[1] == "  skipped 1 line(s) that were not JSON objects (cut short by a crash?)"
    assert "loss: best 0.3333 at step 3, last 0.3333 at step 3 (first 1)" in summary[2]
    missing = lockstep("report", str(tmp_path / "nope"))
    assert (
        missing.returncode == 2
        and "does not exist: give a run folder holding metrics.jsonl" in missing.stderr
    )
    empty = lockstep("report", str(tmp_path / "crashed" / ".."), "--no-plots")
    assert empty.returncode == 0 and "Run crashed" in empty.stdout


def test_missing_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    from lockstep.cli.main import main

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"draws its plots with matplotlib: pip install matplotlib"):
        from lockstep.report import write_plots

        write_plots(read_run(tmp_path / "metrics.jsonl"), tmp_path / "out")
    assert main(["report", str(tmp_path)]) == 2
    assert main(["report", str(tmp_path), "--no-plots"]) == 0


def test_restart_events_are_listed_on_the_timeline(tmp_path):
    """A resized load writes its restart line as an event record (``lockstep/event``): read and listed."""
    log = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 1, "time": 1.0, "loss": 2.0},
        {
            "step": 4,
            "time": 2.0,
            "lockstep/event": "resumed on 2 processes from a checkpoint saved on 3: c at step 4",
        },
        {"step": 5, "time": 3.0, "loss": 1.5},
    ]
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = read_run(log)
    assert run.events == [(4.0, "resumed on 2 processes from a checkpoint saved on 3: c at step 4")]
    summary = summarize(run)
    assert summary[-2:] == [
        "  events:",
        "  at step 4: resumed on 2 processes from a checkpoint saved on 3: c at step 4",
    ]
    assert "loss" in run.series and "lockstep/event" not in run.series
