"""The hang watchdog: one thread per rank that notices when training stops making progress.

Progress is a completed optimizer step or a completed collective of the main thread. Once the first
step has completed, a rank that sees no progress for the window (see ``HangDetectionKwargs``) starts a
diagnosis; so does a rank whose collective hits the process-group timeout, and every rank that hears
from the store that another rank started one. A diagnosis:

1. announces the hang in the store (the first announcer's reason is the one printed);
2. writes this rank's stacks and collective record to ``<dump_dir>/rank_<r>.txt`` / ``.json``;
3. publishes a short report and collects the others' (waiting at most ``report_grace`` seconds);
4. on the lowest-numbered reporting rank, prints one summary line (``lockstep launch`` prints it
   instead, from the error record every rank leaves for the elastic agent);
5. exits the process with code 124 (``os._exit``: a rank blocked in a collective cannot unwind).
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from typing import NoReturn

import torch.distributed as dist

from lockstep.diagnostics import collective_log
from lockstep.diagnostics.collective_log import CollectiveEntry, CollectiveLog
from lockstep.diagnostics.dump import write_dump
from lockstep.diagnostics.exchange import PeerExchange
from lockstep.diagnostics.hang_summary import HANG_EXIT_CODE, RankReport, hang_line, summarize
from lockstep.diagnostics.records import write_error_record
from lockstep.diagnostics.settings import WatchdogPlan
from lockstep.diagnostics.stacks import format_all_threads, traceback_location, user_location
from lockstep.errors import ReplicaQuorumError

logger = logging.getLogger(__name__)

_STEP_HISTORY = 100


def is_collective_timeout(error: BaseException) -> bool:
    """Whether ``error`` is a process-group timeout (gloo's ``Timed out waiting``, NCCL's watchdog); a
    fault-tolerant group's lost lighthouse or quorum is not (its own error says it)."""
    if isinstance(error, ReplicaQuorumError):
        return False
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def is_communication_error(error: BaseException) -> bool:
    """Whether ``error`` came from the communication layer (e.g. a peer that left during a diagnosis)."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error).lower()
    return any(word in text for word in ("connection", "peer", "gloo", "nccl", "socket"))


class HangWatchdog:
    """Watches one rank. Create it after the process group, then :meth:`start` it.

    Args:
        plan: the resolved settings.
        rank: this process's global rank.
        world_size: the number of ranks.
        exchange: the store-based channel to the other ranks (None: report alone).
        print_summary: print the summary line here (False when ``lockstep launch`` prints it).
    """

    def __init__(
        self,
        plan: WatchdogPlan,
        *,
        rank: int,
        world_size: int,
        exchange: PeerExchange | None,
        print_summary: bool = True,
    ) -> None:
        self.plan, self.rank, self.world_size = plan, rank, world_size
        self.exchange = exchange
        self.print_summary = print_summary
        self.log = CollectiveLog(plan.history, on_error=self._collective_failed)
        self.steps = 0
        self.last_step: float | None = None
        self._intervals: collections.deque[float] = collections.deque(maxlen=_STEP_HISTORY)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._diagnosing = False
        self._thread: threading.Thread | None = None
        self.poll = 1.0 if plan.timeout is None else min(1.0, max(0.05, plan.timeout / 10))
        self.group = dist.group.WORLD if dist.is_initialized() else None
        self._raised_at: str | None = None
        self._unrecorded_timeout = False

    # -- progress ---------------------------------------------------------------------------------
    def note_step(self) -> None:
        """An optimizer step completed (called by prepared optimizers; a few hundred nanoseconds)."""
        now = time.monotonic()
        if self.last_step is not None:
            self._intervals.append(now - self.last_step)
        self.last_step = now
        self.steps += 1

    def median_step(self) -> float | None:
        intervals = list(self._intervals)
        return statistics.median(intervals) if intervals else None

    def seconds_since_progress(self) -> float | None:
        if self.last_step is None:
            return None
        return time.monotonic() - max(self.last_step, self.log.last_finished)

    # -- the thread -------------------------------------------------------------------------------
    def start(self) -> None:
        collective_log.install(self.log)
        self._thread = threading.Thread(target=self._run, name="lockstep-hang-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching and give torch.distributed its own functions back."""
        self._stop.set()
        collective_log.uninstall(self.log)
        self.exchange = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def watches_current_group(self) -> bool:
        return dist.is_initialized() and dist.group.WORLD is self.group

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                reason = self.check()
            except Exception as error:  # the watchdog must never take training down by itself
                logger.debug("hang watchdog check failed: %s", error)
                continue
            if reason is not None:
                self.diagnose(reason)

    def check(self) -> str | None:
        """Why a diagnosis should start now, or None."""
        if not self.watches_current_group():
            self.stop()  # the group was torn down (or replaced): this run is over
            return None
        announced = self.exchange.flag() if self.exchange is not None else None
        if announced is not None:
            return announced
        idle = self.seconds_since_progress()
        if idle is None:
            return None  # armed by the first completed step; the process-group timeout covers set-up
        window = self.plan.window(self.median_step())
        if idle <= window:
            return None
        return f"no optimizer step or collective completed on rank {self.rank} for {idle:.0f} s"

    # -- failures seen by the main thread ---------------------------------------------------------
    def _collective_failed(self, entry: CollectiveEntry, error: BaseException) -> None:
        """A recorded collective raised: a process-group timeout, or a peer that left during a diagnosis."""
        reason = f"{entry.op} #{entry.seq} on rank {self.rank} hit the process-group timeout"
        self.on_error(error, reason, recorded=True)

    def on_error(
        self, error: BaseException, timeout_reason: str | None = None, *, recorded: bool = False
    ) -> None:
        """Turn a collective timeout (or any error during another rank's diagnosis) into a diagnosis.

        Args:
            error: what the main thread raised.
            timeout_reason: the reason to give when ``error`` is a timeout.
            recorded: ``error`` came out of a recorded collective (else, e.g., out of DDP's backward).
        """
        if self._stop.is_set():
            return
        if self._diagnosing:
            self._wait_for_exit()
        timeout = is_collective_timeout(error)
        if not (timeout or is_communication_error(error)):
            return  # the user's own error: no need to ask the store
        announced = self.exchange.flag() if self.exchange is not None else None
        if announced is None and not timeout:
            return
        if not recorded:  # the stack has unwound: say where it was raised
            self._raised_at = traceback_location(error)
            self._unrecorded_timeout = timeout
        if announced is not None:
            self.diagnose(announced)
        self.diagnose(
            timeout_reason or f"a collective torch issued on rank {self.rank} hit the process-group timeout"
        )

    # -- diagnosis --------------------------------------------------------------------------------
    def diagnose(self, reason: str) -> NoReturn:
        """Report this rank, summarize all ranks, and exit the process with code 124."""
        with self._lock:
            first = not self._diagnosing
            self._diagnosing = True
        if not first:
            self._wait_for_exit()
        try:
            self._report(reason)
        except BaseException:  # still exit: a half-written report beats a hang
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(HANG_EXIT_CODE)

    def _wait_for_exit(self) -> NoReturn:
        """Another thread of this process is diagnosing and will end the process."""
        while True:
            time.sleep(1.0)

    def own_report(self, reason: str) -> RankReport:
        now = time.monotonic()
        in_flight = self.log.in_flight()
        last_done = self.log.last_done()
        wall = time.time() - now
        return RankReport(
            rank=self.rank,
            reason=reason,
            in_flight=in_flight.to_dict(now, wall) if in_flight else None,
            last_done=last_done.to_dict(now, wall) if last_done else None,
            location=self._raised_at or user_location(self.log.main_thread),
            unrecorded_timeout=self._unrecorded_timeout,
            steps=self.steps,
            seconds_since_progress=self.seconds_since_progress(),
            host=socket.gethostname(),
            pid=os.getpid(),
        )

    def _report(self, reason: str) -> None:
        exchange = self.exchange
        reason = exchange.raise_flag(reason) if exchange is not None else reason
        report = self.own_report(reason)
        now, wall = time.monotonic(), time.time() - time.monotonic()
        entries = [entry.to_dict(now, wall) for entry in self.log.snapshot()]
        write_dump(self.plan.dump_dir, report, self.world_size, entries, format_all_threads())
        reports = {self.rank: report}
        if exchange is not None:
            exchange.publish(report.to_dict())
            collected = exchange.collect(self.plan.report_grace)
            reports.update({rank: RankReport.from_dict(data) for rank, data in collected.items()})
        line = hang_line(reason, summarize(list(reports.values()), self.world_size), self.plan.dump_dir)
        printer = min(reports) == self.rank
        site = report.in_flight["site"] if report.in_flight else (report.location or "")
        write_error_record(line, printer=printer, location=site, dump_dir=self.plan.dump_dir)
        if printer:
            if self.print_summary:
                print(line, file=sys.stderr, flush=True)
            _write_summary(self.plan.dump_dir, line)
            if exchange is not None:
                exchange.mark_done()
        elif exchange is not None:
            exchange.wait_done(self.plan.report_grace)


def _write_summary(dump_dir: str, line: str) -> None:
    try:
        with open(os.path.join(dump_dir, "summary.txt"), "w") as handle:
            handle.write(line + "\n")
    except OSError as error:
        logger.debug("could not write the hang summary: %s", error)
