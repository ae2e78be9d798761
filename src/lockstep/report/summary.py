"""The short text summary of a run: steps, best and last loss, median throughput, where time went."""

from __future__ import annotations

import statistics

from lockstep.report.runlog import (
    COMMUNICATION,
    STEP_TIME_TOTAL,
    UNITS,
    RunLog,
    Series,
    loss_keys,
    lr_keys,
    phase_keys,
    throughput_keys,
)


def _fmt(value: float) -> str:
    """Four significant digits, without a float's noise."""
    return f"{value:.4g}"


def _si(value: float) -> str:
    """``679.9 k``, ``1.42 M``: rates with SI prefixes."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.4g} {prefix}"
    return f"{value:.4g}"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def summarize(run: RunLog) -> list[str]:
    """The summary lines for ``run``."""
    steps = sorted({step for series in run.series.values() for step in series.steps})
    lines = [f"Run {run.name} ({run.path}): {run.records} records"]
    if steps:
        lines[0] += f", {len(steps)} steps ({_fmt(steps[0])} to {_fmt(steps[-1])})"
    if len(run.times) >= 2:
        lines[0] += f", {_duration(max(run.times) - min(run.times))} from first to last record"
    if run.skipped_lines:
        lines.append(
            f"  skipped {run.skipped_lines} line(s) that were not JSON objects (cut short by a crash?)"
        )
    lines += _loss_lines(run) + _lr_lines(run) + _throughput_lines(run) + _time_lines(run)
    events = [f"  at step {_fmt(step)}: {text}" for step, text in run.events]
    if len(lines) == 1 + bool(run.skipped_lines) and not events:
        lines.append("  no loss, learning rate, throughput or time/* metrics in this log")
    return lines + (["  events:", *events] if events else [])


def _loss_lines(run: RunLog) -> list[str]:
    lines = []
    for key in loss_keys(run):
        series = run.series[key]
        best = min(range(len(series)), key=series.values.__getitem__)
        lines.append(
            f"  {key}: best {_fmt(series.values[best])} at step {_fmt(series.steps[best])}, "
            f"last {_fmt(series.values[-1])} at step {_fmt(series.steps[-1])} (first {_fmt(series.values[0])})"
        )
    return lines


def _lr_lines(run: RunLog) -> list[str]:
    return [
        f"  {key}: {_fmt(run.series[key].values[0])} -> {_fmt(run.series[key].values[-1])} "
        f"(max {_fmt(max(run.series[key].values))})"
        for key in lr_keys(run)
    ]


def _throughput_lines(run: RunLog) -> list[str]:
    lines = [
        f"  {UNITS[key]}: median {_si(statistics.median(run.series[key].values))} "
        f"over {len(run.series[key])} logged values (all processes)"
        for key in throughput_keys(run)
    ]
    if "mfu" in run.series:
        lines.append(f"  MFU: median {100 * statistics.median(run.series['mfu'].values):.1f}%")
    return lines


def _steps_covered(series: Series) -> list[float]:
    """How many steps each record stands for: throughput accounting logs every n-th step the average of
    the n steps since its previous record, so a record at step s covers s minus the previous record's step."""
    weights, previous = [], 0.0
    for step in series.steps:
        weights.append(step - previous if step > previous else 1.0)
        previous = step
    return weights


def _seconds(series: Series) -> float:
    return sum(value * weight for value, weight in zip(series.values, _steps_covered(series)))


def _time_lines(run: RunLog) -> list[str]:
    phases = {key: _seconds(run.series[key]) for key in phase_keys(run)}
    if not phases:
        return []
    reference = run.series.get(STEP_TIME_TOTAL) or run.series[max(phases, key=lambda k: len(run.series[k]))]
    total = _seconds(run.series[STEP_TIME_TOTAL]) if STEP_TIME_TOTAL in run.series else sum(phases.values())
    if total <= 0:
        return []
    steps = sum(_steps_covered(reference))
    ordered = sorted(phases.items(), key=lambda item: -item[1])
    parts = ", ".join(f"{key[len('time/') :]} {100 * seconds / total:.1f}%" for key, seconds in ordered)
    lines = [f"  where time went ({_duration(total)} in {steps:g} steps{_median_step(run)}): {parts}"]
    if COMMUNICATION in run.series:
        share = 100 * _seconds(run.series[COMMUNICATION]) / total
        lines.append(f"  exposed communication: {share:.1f}% of step time (inside forward_backward)")
    return lines


def _median_step(run: RunLog) -> str:
    if STEP_TIME_TOTAL not in run.series:
        return ""
    return f", median logged step time {1000 * statistics.median(run.series[STEP_TIME_TOTAL].values):.1f} ms"
