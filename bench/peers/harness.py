"""The pure parts of the peers benchmark: ABBA scheduling, ratios and their spread, the result file's
schema, the equal-work check, the table and the charts.

Nothing here imports torch or a peer, so the tests run it without the peers' environment. The workers
(``_step_worker.py``, ``_checkpoint_worker.py``) time the tools and hand their raw samples to
:func:`summarize`; ``run.py`` assembles one result with :func:`make_result` and writes it.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

SCHEMA = "lockstep-peers/1"
BASELINE = "torch"
TOOLS = ("torch", "lockstep", "accelerate", "fabric")
LABELS = {
    "torch": "hand-written PyTorch",
    "lockstep": "lockstep",
    "accelerate": "Accelerate",
    "fabric": "Lightning Fabric",
}
# kind "ratio": tool / hand-written per block (lower is better); "delta": tool - hand-written per block,
# in the measure's unit (import time over `import torch`).
KINDS = ("ratio", "delta")
LOSS_TOLERANCE = 1e-5


def abba_order(tools: Sequence[str], blocks: int) -> list[list[str]]:
    """The order the tools run in, block by block: forward on even blocks, reversed on odd ones, so a
    drift in the machine's load hits every tool alike (ABBA for two tools, ABCD DCBA for four).

    >>> abba_order(["a", "b"], 4)
    [['a', 'b'], ['b', 'a'], ['a', 'b'], ['b', 'a']]
    """
    if blocks < 1:
        raise ValueError(f"abba_order(blocks={blocks}) is invalid: it must be >= 1.")
    forward = list(tools)
    return [forward if block % 2 == 0 else forward[::-1] for block in range(blocks)]


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile); a single value is all three."""
    if not values:
        raise ValueError("quartiles() of no values: every tool needs at least one block.")
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def summarize(
    samples: Mapping[str, Sequence[float]], kind: str = "ratio", baseline: str = BASELINE
) -> dict[str, dict[str, Any]]:
    """Per tool: the median of its raw samples and the median (with quartiles, min and max) of its
    per-block comparison with ``baseline``, block ``i`` of a tool against block ``i`` of the baseline.

    >>> summarize({"torch": [2.0, 4.0], "x": [3.0, 4.0]})["x"]["ratio"]
    1.25
    """
    if kind not in KINDS:
        raise ValueError(f"summarize(kind={kind!r}) is invalid: use one of {KINDS}.")
    if baseline not in samples:
        raise ValueError(f"summarize() needs the baseline {baseline!r} among the tools {sorted(samples)}.")
    base = samples[baseline]
    summary = {}
    for tool, values in samples.items():
        if len(values) != len(base):
            raise ValueError(
                f"summarize(): {tool} has {len(values)} blocks and {baseline} {len(base)}; "
                "compare only blocks run side by side."
            )
        if kind == "ratio":
            per_block = [value / reference for value, reference in zip(values, base)]
        else:
            per_block = [value - reference for value, reference in zip(values, base)]
        q1, median, q3 = quartiles(per_block)
        summary[tool] = {
            "median": statistics.median(values),
            kind: median,
            "q1": q1,
            "q3": q3,
            "min": min(per_block),
            "max": max(per_block),
            "blocks": len(values),
            "samples": list(values),
        }
    return summary


def measure(
    title: str,
    unit: str,
    samples: Mapping[str, Sequence[float]],
    *,
    kind: str = "ratio",
    load_average: Sequence[float],
    notes: Mapping[str, str] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One measure of the result file: its title, unit, the load average when it was taken, the summary
    per tool, and a note per tool where the figure needs one (a fallback, a missing feature). ``extra``
    may hold ``flags``: a few words per tool whose figure does not measure the same work (the table and
    the chart show them)."""
    return {
        "title": title,
        "unit": unit,
        "kind": kind,
        "load_average": [round(x, 2) for x in load_average],
        "tools": summarize(samples, kind),
        "notes": dict(notes or {}),
        **dict(extra or {}),
    }


def equal_work(runs: Mapping[str, Mapping[str, Any]], tolerance: float = LOSS_TOLERANCE) -> dict[str, Any]:
    """Check that the tools did the same work: the same number of optimizer steps, and the same final loss
    within ``tolerance`` of the hand-written loop's.

    ``runs`` maps a tool to ``{"steps": int, "final_loss": float}``; a run may also say
    ``"same_order": False`` when its data order differs from the hand-written loop's, in which case its
    loss is reported but not held to the tolerance.
    """
    if BASELINE not in runs:
        raise ValueError(f"equal_work() needs the baseline {BASELINE!r} among the runs {sorted(runs)}.")
    base = runs[BASELINE]
    tools = {}
    for tool, run in runs.items():
        diff = abs(run["final_loss"] - base["final_loss"])
        same_order = bool(run.get("same_order", True))
        tools[tool] = {
            "steps": run["steps"],
            "final_loss": run["final_loss"],
            "loss_diff": diff,
            "same_order": same_order,
            "ok": run["steps"] == base["steps"] and (diff <= tolerance or not same_order),
        }
    return {"tolerance": tolerance, "ok": all(t["ok"] for t in tools.values()), "tools": tools}


def make_result(
    *,
    date: str,
    machine: Mapping[str, Any],
    versions: Mapping[str, str],
    settings: Mapping[str, Any],
    measures: Mapping[str, Mapping[str, Any]],
    checks: Mapping[str, Any],
) -> dict[str, Any]:
    """The whole result file; :func:`validate` holds it to the schema before it is written."""
    result = {
        "schema": SCHEMA,
        "date": date,
        "machine": dict(machine),
        "versions": dict(versions),
        "settings": dict(settings),
        "measures": {name: dict(m) for name, m in measures.items()},
        "checks": dict(checks),
    }
    validate(result)
    return result


def validate(result: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming every place where ``result`` departs from the schema."""
    problems = []
    if result.get("schema") != SCHEMA:
        problems.append(f"schema is {result.get('schema')!r}, expected {SCHEMA!r}")
    for key, kind in (("date", str), ("machine", dict), ("versions", dict), ("measures", dict)):
        if not isinstance(result.get(key), kind):
            problems.append(f"{key} is missing or not a {kind.__name__}")
    for name, entry in (result.get("measures") or {}).items():
        for key in ("title", "unit", "kind", "load_average", "tools"):
            if key not in entry:
                problems.append(f"measures.{name}.{key} is missing")
        if entry.get("kind") not in KINDS:
            problems.append(f"measures.{name}.kind is {entry.get('kind')!r}, expected one of {KINDS}")
        tools = entry.get("tools") or {}
        if BASELINE not in tools:
            problems.append(f"measures.{name}.tools has no {BASELINE!r} baseline")
        for tool, figures in tools.items():
            if tool not in TOOLS:
                problems.append(f"measures.{name}.tools.{tool} is not one of {TOOLS}")
            for key in ("median", entry.get("kind"), "q1", "q3", "samples"):
                if key not in figures:
                    problems.append(f"measures.{name}.tools.{tool}.{key} is missing")
    if problems:
        raise ValueError("the peers result departs from its schema: " + "; ".join(problems))


def headline(entry: Mapping[str, Any], tool: str) -> str:
    """The figure of one tool in one measure as the table shows it."""
    figures = entry["tools"].get(tool)
    if figures is None:
        return "n/a"
    flag = entry.get("flags", {}).get(tool)
    suffix = f" [{flag}]" if flag else ""
    if entry["kind"] == "delta":
        return f"{figures['delta']:+.2f} {entry['unit']}{suffix}"
    return f"{figures['ratio']:.3f} ({figures['q1']:.2f}-{figures['q3']:.2f}){suffix}"


def format_table(result: Mapping[str, Any], tools: Iterable[str] = TOOLS) -> str:
    """A Markdown table: one row per measure, one column per tool, each cell the median ratio to
    hand-written PyTorch with the quartiles of the blocks (or the difference, for import time)."""
    tools = list(tools)
    lines = [
        "| measure | " + " | ".join(LABELS[t] for t in tools) + " | load avg |",
        "|---" * (len(tools) + 2) + "|",
    ]
    for entry in result["measures"].values():
        cells = [headline(entry, tool) for tool in tools]
        load = "/".join(f"{x:.1f}" for x in entry["load_average"])
        lines.append(f"| {entry['title']} | " + " | ".join(cells) + f" | {load} |")
    return "\n".join(lines)


def write_charts(result: Mapping[str, Any], folder: Path, stem: str) -> list[Path]:
    """One PNG per measure: a bar per tool at its median ratio to hand-written PyTorch (or difference),
    the quartiles of the blocks as error bars, and the date, versions and load average in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    versions = ", ".join(f"{k} {v}" for k, v in result["versions"].items())
    paths = []
    for name, entry in result["measures"].items():
        tools = [t for t in TOOLS if t in entry["tools"]]
        kind = entry["kind"]
        centers = [entry["tools"][t][kind] for t in tools]
        lower = [c - entry["tools"][t]["q1"] for c, t in zip(centers, tools)]
        upper = [entry["tools"][t]["q3"] - c for c, t in zip(centers, tools)]
        figure, axes = plt.subplots(figsize=(6.4, 3.6), dpi=80)
        colors = ["#888888" if t == BASELINE else "#1f77b4" if t == "lockstep" else "#ff7f0e" for t in tools]
        bars = axes.bar([LABELS[t] for t in tools], centers, yerr=[lower, upper], capsize=4, color=colors)
        axes.bar_label(bars, fmt="%.2f" if kind == "ratio" else "%+.2f", label_type="center", fontsize=8)
        if kind == "ratio" and max(centers) > 10 * min(centers):  # a 100x bar would flatten the others
            axes.set_yscale("log")
        for index, tool in enumerate(tools):  # a figure that does not measure the same thing says so
            if tool in entry.get("flags", {}):
                axes.annotate(
                    entry["flags"][tool], (index, centers[index]), ha="center", va="bottom", fontsize=8
                )
        reference = 1.0 if kind == "ratio" else 0.0
        axes.axhline(reference, color="black", linewidth=0.8)
        axes.set_ylabel("ratio to hand-written" if kind == "ratio" else f"extra {entry['unit']}")
        load = "/".join(f"{x:.1f}" for x in entry["load_average"])
        axes.set_title(f"{entry['title']}\n{result['date']}, load {load}", fontsize=9)
        figure.text(0.01, 0.01, versions, fontsize=6)
        figure.tight_layout(rect=(0, 0.04, 1, 1))
        path = folder / f"{stem}-{name}.png"
        figure.savefig(path)
        plt.close(figure)
        paths.append(path)
    return paths
