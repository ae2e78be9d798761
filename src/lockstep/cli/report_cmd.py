"""``lockstep report RUN_DIR``: a text summary and PNG plots of a run's ``jsonl`` logs.

RUN_DIR is ``logging_dir/project_name`` (the folder holding ``metrics.jsonl``), the file itself, or the
logging folder (every run below it is reported). Plots go to ``RUN_DIR/report/`` unless ``--output``.

Examples::

    lockstep report runs/exp1/sentiment
    lockstep report runs/exp1 --output /tmp/plots
    lockstep report runs/exp1/sentiment --no-plots
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lockstep.errors import UsageError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "report",
        help="summarize a run's jsonl logs and plot loss, learning rate, throughput and step time",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run folder holding metrics.jsonl (or the file)")
    parser.add_argument("--output", "-o", help="folder for the PNG files (default: RUN_DIR/report)")
    parser.add_argument(
        "--no-plots", action="store_true", help="print the summary only (no matplotlib needed)"
    )
    parser.set_defaults(handler=run_report)


def run_report(args: argparse.Namespace) -> int:
    from lockstep.report import find_metric_files, read_run, summarize, write_plots
    from lockstep.report.plots import import_matplotlib

    files = find_metric_files(args.run_dir)
    if not args.no_plots:
        try:
            import_matplotlib()
        except ImportError as error:
            raise UsageError(f"{error}; or pass --no-plots for the summary alone.") from None
    for index, path in enumerate(files):
        run = read_run(path)
        if index:
            print()
        print("\n".join(summarize(run)))
        if args.no_plots:
            continue
        output = Path(args.output) if args.output else path.parent / "report"
        if args.output and len(files) > 1:
            output = output / run.name
        written = write_plots(run, output)
        print(f"  plots: {', '.join(str(p) for p in written) if written else 'none (no metric to plot)'}")
    return 0
