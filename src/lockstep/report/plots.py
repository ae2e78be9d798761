"""PNG plots of a run: loss, learning rate, throughput, step-time breakdown (needs matplotlib).

Figures are drawn with ``matplotlib.figure.Figure`` directly (no pyplot), so no window opens, no global
backend is changed, and nothing is left open between plots.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from lockstep.report.runlog import (
    COMMUNICATION,
    UNITS,
    RunLog,
    Series,
    loss_keys,
    lr_keys,
    phase_keys,
    throughput_keys,
)

INSTALL = "pip install matplotlib  (or: pip install 'lockstep[report]')"
_SMOOTH_ABOVE = 30  # points; noisier series get a smoothed line over the raw one
_PHASE_COLORS = {
    "time/data": "#4c72b0",
    "time/forward_backward": "#dd8452",
    "time/optimizer": "#55a868",
    "time/checkpoint": "#c44e52",
    "time/other": "#8c8c8c",
}


def import_matplotlib() -> Any:
    """``matplotlib.figure``, or an ImportError that says how to install it."""
    try:
        from matplotlib import figure
    except ImportError:
        raise ImportError(f"lockstep report draws its plots with matplotlib: {INSTALL}") from None
    return figure


def write_plots(run: RunLog, output: str | Path) -> list[Path]:
    """Write ``loss.png``, ``learning_rate.png``, ``throughput.png``, ``step_time.png`` (those with data)."""
    figure_module = import_matplotlib()
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in (
        ("loss.png", _draw_loss),
        ("learning_rate.png", _draw_lr),
        ("throughput.png", _draw_throughput),
        ("step_time.png", _draw_step_time),
    ):
        fig = draw(figure_module, run)
        if fig is None:
            continue
        path = output / name
        fig.savefig(path, dpi=110)
        written.append(path)
    return written


def _ema(values: list[float], points: int) -> list[float]:
    """Exponential moving average with a window of about 1/20 of the points (bias-corrected start)."""
    alpha = 2 / (max(points // 20, 2) + 1)
    smoothed, average, weight = [], 0.0, 0.0
    for value in values:
        average = (1 - alpha) * average + alpha * value
        weight = (1 - alpha) * weight + alpha
        smoothed.append(average / weight)
    return smoothed


def _new_figure(figure_module: Any, title: str, *, nrows: int = 1, width: float = 8) -> Any:
    fig = figure_module.Figure(figsize=(width, 3.6 * nrows), layout="constrained")
    fig.suptitle(title, fontsize=13)
    return fig


def _plot_series(ax: Any, key: str, series: Series, color: Any = None) -> None:
    if len(series) > _SMOOTH_ABOVE:
        (raw,) = ax.plot(
            series.steps, series.values, alpha=0.3, linewidth=0.8, color=color, label=f"{key} (raw)"
        )
        ax.plot(
            series.steps,
            _ema(series.values, len(series)),
            color=raw.get_color(),
            linewidth=1.8,
            label=f"{key} (smoothed)",
        )
    else:
        ax.plot(
            series.steps,
            series.values,
            marker="o" if len(series) < 15 else None,
            markersize=3,
            color=color,
            label=key,
        )


def _draw_loss(figure_module: Any, run: RunLog) -> Any:
    keys = loss_keys(run)
    if not keys:
        return None
    fig = _new_figure(figure_module, f"{run.name}: loss")
    ax = fig.subplots()
    for key in keys:
        _plot_series(ax, key, run.series[key])
    values = [v for key in keys for v in run.series[key].values]
    log_scale = min(values) > 0 and max(values) / min(values) > 50
    if log_scale:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (log scale)" if log_scale else "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def _draw_lr(figure_module: Any, run: RunLog) -> Any:
    keys = lr_keys(run)
    if not keys:
        return None
    fig = _new_figure(figure_module, f"{run.name}: learning rate")
    ax = fig.subplots()
    for key in keys:
        ax.plot(run.series[key].steps, run.series[key].values, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def _draw_throughput(figure_module: Any, run: RunLog) -> Any:
    keys = throughput_keys(run)
    if not keys:
        return None
    fig = _new_figure(figure_module, f"{run.name}: throughput (all processes)", nrows=len(keys))
    axes = fig.subplots(len(keys), 1, sharex=True, squeeze=False)[:, 0]
    from matplotlib.ticker import EngFormatter

    for ax, key in zip(axes, keys):
        series = run.series[key]
        unit = UNITS.get(key, key)
        _plot_series(ax, unit, series)
        median = statistics.median(series.values)
        label = f"median {EngFormatter(places=1).format_data(median)} {unit}"
        ax.axhline(median, linestyle="--", color="black", linewidth=1, label=label)
        ax.yaxis.set_major_formatter(EngFormatter())
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    axes[-1].set_xlabel("step")
    return fig


def _draw_step_time(figure_module: Any, run: RunLog) -> Any:
    phases = phase_keys(run)
    if not phases:
        return None
    fig = _new_figure(figure_module, f"{run.name}: where each step's time went", width=11)
    per_step, share = fig.subplots(1, 2, width_ratios=[2.2, 1])
    steps = run.series[phases[0]].steps
    aligned = [key for key in phases if run.series[key].steps == steps]  # stack only phases logged together
    colors = [_PHASE_COLORS.get(key) for key in aligned]
    per_step.stackplot(
        steps,
        [[1000 * v for v in run.series[key].values] for key in aligned],
        labels=[key[len("time/") :] for key in aligned],
        colors=colors if None not in colors else None,
        alpha=0.85,
    )
    if COMMUNICATION in run.series:
        comm = run.series[COMMUNICATION]
        per_step.plot(
            comm.steps, [1000 * v for v in comm.values], "k--", linewidth=1, label="exposed communication"
        )
    _clip_slow_first_step(
        per_step, steps, [sum(values) for values in zip(*(run.series[k].values for k in aligned))]
    )
    per_step.set_xlabel("step")
    per_step.set_ylabel("milliseconds per step")
    per_step.set_title("per step (stacked)")
    per_step.grid(alpha=0.3)
    per_step.legend(loc="upper right", fontsize=8)
    totals = {key[len("time/") :]: sum(run.series[key].values) for key in phases}
    grand = sum(totals.values()) or 1.0
    names = sorted(totals, key=totals.get)
    bars = share.barh(
        names,
        [100 * totals[n] / grand for n in names],
        color=[_PHASE_COLORS.get(f"time/{n}", "#999999") for n in names],
    )
    share.bar_label(bars, fmt="%.1f%%", padding=2, fontsize=8)
    share.set_xlabel("share of total step time (%)")
    share.set_xlim(0, 115)
    share.set_title("whole run")
    return fig


def _clip_slow_first_step(ax: Any, steps: list[float], seconds: list[float]) -> None:
    """Keep the y axis for the steady state when the first step (warm-up, FLOP counting) dwarfs the rest."""
    if len(seconds) < 4 or seconds[0] <= 2 * max(seconds[1:]):
        return
    top = 1000 * max(seconds[1:]) * 1.25
    ax.set_ylim(0, top)
    ax.annotate(
        f"step {steps[0]:g}: {1000 * seconds[0]:.0f} ms (off scale)",
        xy=(steps[0], top),
        xytext=(6, -14),
        textcoords="offset points",
        fontsize=8,
        arrowprops={"arrowstyle": "->", "linewidth": 0.8},
    )
