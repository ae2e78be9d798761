"""``lockstep report RUN_DIR``: plots and a text summary from the ``jsonl`` tracker's logs.

Example:
    >>> from lockstep.report import read_run, summarize, write_plots  # doctest: +SKIP
    >>> run = read_run("runs/exp1/metrics.jsonl")  # doctest: +SKIP
    >>> print("\\n".join(summarize(run)))  # doctest: +SKIP
    >>> write_plots(run, "runs/exp1/report")  # doctest: +SKIP
"""

from lockstep.report.plots import write_plots
from lockstep.report.runlog import RunLog, Series, find_metric_files, read_run
from lockstep.report.summary import summarize

__all__ = ["RunLog", "Series", "find_metric_files", "read_run", "summarize", "write_plots"]
