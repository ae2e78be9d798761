"""Hang diagnosis: a record of each rank's last collectives, a watchdog thread, one summary line.

When a distributed run stops making progress, every rank writes its Python stacks (all threads) and its
last collectives to ``<logging_dir>/lockstep_hang/rank_<r>.txt`` (``./lockstep_hang`` without a project
folder), one line says where each rank is, for example::

    lockstep: hang detected (no optimizer step or collective completed on rank 0 for 10 s): rank 0 is
    waiting in all_reduce #8 (train.py:30); rank 1 is waiting in barrier #8 from lockstep
    wait_for_everyone (train.py:33). Stacks and last collectives of each rank: runs/a/lockstep_hang/rank_<r>.txt

and the job exits with code 124 instead of hanging. Configure it with :class:`HangDetectionKwargs` in
``Accelerator(kwargs_handlers=[...])`` or ``LOCKSTEP_HANG_TIMEOUT``.

Modules: ``settings`` (the handler), ``collective_log`` (the record and the torch.distributed wrappers),
``stacks``, ``dump`` (per-rank files), ``exchange`` (talking to the other ranks through the store),
``hang_summary`` (the line, pure), ``watchdog`` (the thread and the diagnosis), ``active_watchdog`` (the process's
one watchdog), ``records`` (the elastic agent's error record).
"""

from lockstep.diagnostics.hang_summary import HANG_EXIT_CODE, RankReport, summarize
from lockstep.diagnostics.settings import HangDetectionKwargs

__all__ = ["HANG_EXIT_CODE", "HangDetectionKwargs", "RankReport", "summarize"]
