"""The pure parts of pipeline_vs_data_parallel.py: the configurations, the bubble, the figures file (its
shape and check), the Markdown table and the chart.

Nothing here imports torch, so the tests run it without starting a process group; the script runs the
workers and hands their per-rank figures to :func:`make_row` and :func:`make_figures`.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = "lockstep-pipeline-vs-data-parallel/1"
MIB = 2**20
ROW_KEYS = ("name", "processes", "stages", "microbatches", "step_ms", "step_ms_rounds", "ranks", "bubble")
RANK_KEYS = ("model_state_bytes", "activation_peak_bytes", "parameters")


@dataclass(frozen=True, kw_only=True)
class Configuration:
    """One row of the comparison.

    Attributes:
        name: the row's label in the table and the chart.
        flags: the worker's command-line flags.
        processes: how many processes torchrun starts.
        stages: pipeline stages (1 when the model is not pipelined).
        microbatches: micro-batches per step of each pipeline (None when not pipelined).
    """

    name: str
    flags: tuple[str, ...]
    processes: int
    stages: int = 1
    microbatches: int | None = None


def configurations() -> list[Configuration]:
    """One process, DDP x2, FSDP x2, pp=2 GPipe and 1F1B at 4/8/16 micro-batches, and pp=2 x dp=2 (1F1B,
    4 micro-batches of each replica's 16 samples: the same micro-batch size as pp=2 at m=8)."""
    rows = [
        Configuration(name="one process", flags=("--mode", "single"), processes=1),
        Configuration(name="DDP x2", flags=("--mode", "ddp"), processes=2),
        Configuration(name="FSDP x2", flags=("--mode", "fsdp"), processes=2),
    ]
    for schedule, label in (("gpipe", "GPipe"), ("1f1b", "1F1B")):
        for m in (4, 8, 16):
            flags = ("--mode", "pp", "--schedule", schedule, "--microbatches", str(m))
            rows.append(
                Configuration(name=f"pp=2 {label} m={m}", flags=flags, processes=2, stages=2, microbatches=m)
            )
    flags = ("--mode", "pp", "--schedule", "1f1b", "--microbatches", "4", "--dp-shard", "2")
    rows.append(
        Configuration(name="pp=2 x dp=2 1F1B m=4", flags=flags, processes=4, stages=2, microbatches=4)
    )
    return rows


def theoretical_bubble(stages: int, microbatches: int) -> float:
    """The idle share of a GPipe or 1F1B step: ``(p - 1) / (m + p - 1)``.

    >>> theoretical_bubble(2, 4)
    0.2
    """
    if stages < 1 or microbatches < 1:
        raise ValueError(
            f"theoretical_bubble(stages={stages}, microbatches={microbatches}) is invalid: both must be >= 1."
        )
    return (stages - 1) / (microbatches + stages - 1)


def measured_bubble(single_ms: float, step_ms: float, processes: int) -> float:
    """The share of a step not explained by a perfect split of one process's work over ``processes``:
    ``1 - (single_ms / processes) / step_ms``.

    >>> measured_bubble(20.0, 20.0, 2)
    0.5
    """
    if single_ms <= 0 or step_ms <= 0:
        raise ValueError(
            f"measured_bubble(single_ms={single_ms}, step_ms={step_ms}) is invalid: step times must be > 0."
        )
    return 1 - (single_ms / processes) / step_ms


def make_row(
    config: Configuration, step_ms_rounds: Sequence[float], ranks: Sequence[Mapping[str, Any]]
) -> dict:
    """One configuration's figures: the median of its rounds' step times (each the slowest rank's), and
    per rank the bytes of model state and of the activation peak. The bubble is filled by
    :func:`make_figures`, which knows the one-process step."""
    if len(ranks) != config.processes:
        raise ValueError(
            f"make_row({config.name!r}): {len(ranks)} ranks reported, expected {config.processes}."
        )
    return {
        "name": config.name,
        "processes": config.processes,
        "stages": config.stages,
        "microbatches": config.microbatches,
        "step_ms": statistics.median(step_ms_rounds),
        "step_ms_rounds": [float(t) for t in step_ms_rounds],
        "ranks": [{key: int(rank[key]) for key in RANK_KEYS} for rank in ranks],
        "bubble": None,
    }


def make_figures(
    *,
    date: str,
    machine: Mapping[str, Any],
    settings: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """The figures file: the rows, with the measured and theoretical bubble added to every pipelined row
    (against the row named ``one process``, which must be there); :func:`validate` checks it."""
    single = next((row for row in rows if row["stages"] == 1 and row["processes"] == 1), None)
    if single is None:
        raise ValueError(f"make_figures() needs a one-process row, among {[row['name'] for row in rows]}.")
    filled = []
    for row in rows:
        row = dict(row)
        if row["stages"] > 1:
            row["bubble"] = {
                "measured": measured_bubble(single["step_ms"], row["step_ms"], row["processes"]),
                "theory": theoretical_bubble(row["stages"], row["microbatches"]),
            }
        filled.append(row)
    figures = {
        "schema": SCHEMA,
        "date": date,
        "machine": dict(machine),
        "settings": dict(settings),
        "rows": filled,
    }
    validate(figures)
    return figures


def validate(figures: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming every place where ``figures`` departs from the schema."""
    problems = []
    if figures.get("schema") != SCHEMA:
        problems.append(f"schema is {figures.get('schema')!r}, expected {SCHEMA!r}")
    for key, kind in (("date", str), ("machine", dict), ("settings", dict), ("rows", list)):
        if not isinstance(figures.get(key), kind):
            problems.append(f"{key} is missing or not a {kind.__name__}")
    for index, row in enumerate(figures.get("rows") or []):
        missing = [key for key in ROW_KEYS if key not in row]
        if missing:
            problems.append(f"rows[{index}] lacks {missing}")
            continue
        if len(row["ranks"]) != row["processes"]:
            problems.append(
                f"rows[{index}] ({row['name']}) has {len(row['ranks'])} ranks for {row['processes']} processes"
            )
        for rank_index, rank in enumerate(row["ranks"]):
            lacking = [key for key in RANK_KEYS if key not in rank]
            if lacking:
                problems.append(f"rows[{index}].ranks[{rank_index}] lacks {lacking}")
        if (row["stages"] > 1) != (row["bubble"] is not None):
            problems.append(f"rows[{index}] ({row['name']}): a bubble belongs to pipelined rows only")
    if problems:
        raise ValueError(
            "the pipeline-vs-data-parallel figures depart from their schema: " + "; ".join(problems)
        )


def _per_rank(row: Mapping[str, Any], key: str, digits: int) -> str:
    return " / ".join(f"{rank[key] / MIB:.{digits}f}" for rank in row["ranks"])


def format_table(figures: Mapping[str, Any]) -> str:
    """The Markdown table of BENCHMARKS.md: one line per configuration, per-rank figures joined by ``/``."""
    lines = [
        "| configuration | processes | step ms | params + grads + AdamW MiB per rank "
        "| peak activations MiB per rank | bubble measured / theory |",
        "|---|---|---|---|---|---|",
    ]
    for row in figures["rows"]:
        bubble = row["bubble"]
        cell = f"{bubble['measured']:.2f} / {bubble['theory']:.2f}" if bubble else ""
        lines.append(
            f"| {row['name']} | {row['processes']} | {row['step_ms']:.1f} | {_per_rank(row, 'model_state_bytes', 1)} "
            f"| {_per_rank(row, 'activation_peak_bytes', 2)} | {cell} |"
        )
    return "\n".join(lines)


def _rank_bars(axes: Any, rows: Sequence[Mapping[str, Any]], key: str, title: str) -> None:
    """Horizontal bars, one group per configuration, one bar per rank (rank 0 on top), in MiB."""
    width = 0.8 / max(len(row["ranks"]) for row in rows)
    for index, row in enumerate(rows):
        count = len(row["ranks"])
        for rank_index, rank in enumerate(row["ranks"]):
            offset = (rank_index - (count - 1) / 2) * width
            value = rank[key] / MIB
            axes.barh(index + offset, value, height=width * 0.9, color=f"C{rank_index}")
        top = max(rank[key] for rank in row["ranks"]) / MIB
        axes.annotate(
            f"{top:.2f}" if top < 10 else f"{top:.1f}",
            (top, index),
            xytext=(3, 0),
            textcoords="offset points",
            va="center",
            fontsize=7,
        )
    axes.set_yticks(range(len(rows)), [row["name"] for row in rows], fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel("MiB per rank (bars: rank 0, 1, ...)", fontsize=8)
    axes.set_title(title, fontsize=9)
    axes.margins(x=0.15)


def _bubble_bars(axes: Any, piped: Sequence[Mapping[str, Any]]) -> None:
    """Per pipelined configuration, the measured bubble (red) over the theoretical one (grey)."""
    positions = range(len(piped))
    measured = [row["bubble"]["measured"] for row in piped]
    theory = [row["bubble"]["theory"] for row in piped]
    axes.barh([p - 0.2 for p in positions], measured, height=0.4, color="#d62728")
    axes.barh([p + 0.2 for p in positions], theory, height=0.4, color="#888888")
    axes.set_yticks(positions, [row["name"] for row in piped], fontsize=8)
    axes.invert_yaxis()
    axes.set_xlim(0, 1)
    axes.set_xlabel("share of the step", fontsize=8)
    axes.set_title("pipeline bubble: measured (red), theory (p-1)/(m+p-1) (grey)", fontsize=9)


def write_chart(figures: Mapping[str, Any], path: Path) -> Path:
    """One PNG of four panels: model state per rank, activation peak per rank, step time, and the measured
    against the theoretical bubble of the pipelined rows; the date, machine and load average in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    validate(figures)
    rows = figures["rows"]
    figure, ((state, activations), (steps, bubbles)) = plt.subplots(2, 2, figsize=(11, 7.5), dpi=80)
    _rank_bars(state, rows, "model_state_bytes", "parameters + gradients + AdamW state")
    _rank_bars(activations, rows, "activation_peak_bytes", "peak activations saved for backward")
    names = [row["name"] for row in rows]
    bars = steps.barh(range(len(rows)), [row["step_ms"] for row in rows], color="#888888")
    steps.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
    steps.set_yticks(range(len(rows)), names, fontsize=8)
    steps.invert_yaxis()
    steps.set_xlabel("ms, median of the slowest rank", fontsize=8)
    steps.set_title(f"step time on {figures['machine'].get('cpus', '?')} shared cores", fontsize=9)
    steps.margins(x=0.15)
    _bubble_bars(bubbles, [row for row in rows if row["bubble"] is not None])
    load = "/".join(f"{x:.1f}" for x in figures["machine"].get("load_average", []))
    settings = ", ".join(f"{k} {v}" for k, v in figures["settings"].items())
    figure.suptitle(
        f"Data parallel vs pipeline parallel, {figures['date']}, load average {load}\n{settings}", fontsize=10
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path
