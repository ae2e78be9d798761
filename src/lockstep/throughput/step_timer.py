"""Per-step throughput accounting: where each optimizer step's time went, and how fast it ran.

A *step* is one optimizer step: with gradient accumulation it spans all its micro-batches. It ends when
every prepared optimizer has stepped (``optimizer.step()`` returned) and the next one begins right
there, so consecutive steps tile the wall clock with no gaps: whatever the loop does after
``optimizer.step()`` (``zero_grad``, the scheduler, logging, evaluation) belongs to the next step.

Each step's time is split into phases that do not overlap and add up to the step:

============================  ===========================================================================
``time/data``                 inside a prepared dataloader's ``__next__`` (waiting for the next batch,
                              collation, the copy to the device)
``time/forward_backward``     from a batch being handed over (or the end of the previous phase) to the
                              end of ``accelerator.backward``
``time/optimizer``            inside ``optimizer.step()`` on a synchronising step
``time/checkpoint``           inside ``save_state`` and ``wait_for_checkpoint`` (the training stall)
``time/other``                the rest: gradient clipping, ``zero_grad``, schedulers, your own code
``time/step``                 the whole step (the sum of the five above)
============================  ===========================================================================

``time/communication`` (only where measured: DDP) is the exposed gradient all-reduce wait, the part of
``time/forward_backward`` after the last gradient was computed (see :mod:`lockstep.throughput.comm`).

Rates: ``samples_per_second`` and ``tokens_per_second`` (tokens are ``attention_mask`` ones, else
``input_ids`` elements, present only for such batches), and ``flops_per_second`` (model FLOPs counted
once on the first step, scaled to each step's padded input size) are for the whole job: this process's
count times the number of processes (exact for samples, since prepared loaders give every process the
same batch size; an estimate for tokens). The batches counted are those trained on: the last batch a
prepared loader handed over before each ``accelerator.backward`` (an evaluation loop run in the middle
of training adds its reading time to ``time/data`` but no samples). ``mfu`` is achieved FLOP/s over
the peak of the devices, on GPUs of :mod:`lockstep.throughput.peak_flops` only (absent on the CPU).

Times on CUDA are device time, from CUDA events read once per step; on the CPU, ``time.perf_counter``.

Every ``ThroughputKwargs(log_every_n_steps=...)`` steps (10 by default) the figures of those steps (times
averaged per step, rates over all of them) go to the running trackers through ``accelerator.log``, with
``step`` = the number of optimizer steps measured so far; ``accelerator.step_stats`` always holds the last
step's own figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from lockstep.step_hooks import StepHook
from lockstep.throughput.batch_counts import BatchCounts
from lockstep.throughput.clock import CpuClock, clock_for
from lockstep.throughput.comm import ExposedCommunication
from lockstep.throughput.config import ThroughputKwargs
from lockstep.throughput.figures import StepTotals, figures
from lockstep.throughput.flops import FlopCounting
from lockstep.throughput.peak_flops import compute_dtype_name, device_peak_flops

_NOT_LOOKED_UP = object()


class _Window:
    """A reusable context manager calling ``started()`` on entry and ``finished()`` on exit (even on errors).

    Cheaper than ``contextlib.contextmanager``, which builds a generator per use: it runs on every step.
    """

    __slots__ = ("_finished", "_started")

    def __init__(self, started: Callable[[], Any], finished: Callable[[], Any]) -> None:
        self._started, self._finished = started, finished

    def __enter__(self) -> None:
        self._started()

    def __exit__(self, *exc_info: object) -> None:
        self._finished()


class StepTimer(StepHook):
    """Measures every optimizer step of one Accelerator (built by :func:`build_step_timer`): one of its step
    hooks (:mod:`lockstep.step_hooks`), plus the checkpoint window the Accelerator's saves run in.

    The hooks run on every step, so they only take clock marks and append to lists; the figures are
    computed when read (``stats``) or logged.

    Args:
        config: the settings.
        device: the training device (picks the clock).
        num_processes: processes in the job (rates are for the whole job).
        models: returns the prepared models.
        optimizers: returns the prepared optimizers.
        mixed_precision: returns the Accelerator's mixed-precision mode.
        log: ``log(values, step)``, called with the figures of every ``log_every_n_steps`` steps when
            ``logging_active()`` is true.
        logging_active: whether any tracker is running.
        clock: marks instants (default: the device's, see :func:`~lockstep.throughput.clock.clock_for`).
    """

    enabled = True

    def __init__(
        self,
        config: ThroughputKwargs,
        *,
        device: torch.device,
        num_processes: int,
        models: Callable[[], Sequence[nn.Module]],
        optimizers: Callable[[], Sequence[Any]],
        mixed_precision: Callable[[], str],
        log: Callable[[dict[str, float], int], None],
        logging_active: Callable[[], bool],
        clock: CpuClock | None = None,
    ) -> None:
        self.config = config
        self.device = device
        self.clock = clock_for(device) if clock is None else clock
        self._cpu = type(self.clock) is CpuClock
        self._mark = time.perf_counter if self._cpu else self.clock.mark  # no extra call on the CPU
        self.num_processes = num_processes
        self._models, self._optimizers = models, optimizers
        self._mixed_precision = mixed_precision
        self._log, self._logging_active = log, logging_active
        self._flops = FlopCounting(models) if config.count_flops else None
        self._counted_flops: tuple[float, int] | None = None  # (FLOPs, padded elements) of the counted step
        self._comm = ExposedCommunication(self.clock) if num_processes > 1 else None
        self._peak: Any = _NOT_LOOKED_UP
        self.steps = 0
        """Optimizer steps measured so far."""
        self._last: StepTotals | None = None
        self._stats: dict[str, float] | None = None  # figures of _last, computed when first read
        self._window: list[StepTotals] = []  # the steps since the last log
        self._step_start: Any = None
        self._cursor: Any = None  # the end of the last measured phase: where forward_backward starts
        self._handed_over: Any = None  # the last batch a prepared loader handed over, until a backward
        self._syncing = False
        self._stepping = 0
        self._intervals: list[tuple[str, Any, Any]] = []
        self._comm_intervals: list[tuple[Any, Any]] = []
        self._open: list[list[Any]] = []  # [phase, start of its current segment], innermost last
        self._counts = BatchCounts()
        self._backwards = 0
        self._stepped: set[int] = set()
        self._backward_window = _Window(self._backward_started, self._backward_finished)
        self._optimizer_window = _Window(self._optimizer_started, self._optimizer_finished)
        self._checkpoint_window = _Window(lambda: self._enter("checkpoint"), lambda: self._exit("checkpoint"))

    # -- the step hooks, and what the Accelerator calls ----------------------------------------------
    @property
    def stats(self) -> dict[str, float]:
        """The last completed step's figures (empty before the first step ends)."""
        if self._last is None:
            return {}
        if self._stats is None:
            self._stats = figures(self._last, num_processes=self.num_processes, peak_flops=self._peak_flops())
        return dict(self._stats)

    def batches(self, batches: Iterable[Any]) -> Iterator[Any]:
        """Yield ``batches``, timing each ``next()`` as ``time/data``."""
        iterator = iter(batches)
        while True:
            self._enter("data")
            try:
                batch = next(iterator)
            except StopIteration:
                self._exit("data")
                return
            except BaseException:
                self._exit("data")
                raise
            self._exit("data")
            self._handed_over = batch
            yield batch

    def around_backward(self) -> _Window:
        """Around ``accelerator.backward``: ends a ``time/forward_backward`` interval."""
        return self._backward_window

    def _backward_started(self) -> None:
        if self._step_start is None:
            self._begin(self._mark())
        if self._comm is not None:
            self._syncing = self._comm.before_backward(self._models())
        if self._handed_over is not None:  # the batch this backward trains on
            self._counts.add(self._handed_over)
            self._handed_over = None
        self._backwards += 1
        if self._flops is not None:
            self._flops.open_backward()

    def _backward_finished(self) -> None:
        if self._flops is not None:
            self._flops.close_backward()
        end = self._mark()
        last_gradient = None if self._comm is None else self._comm.after_backward(self._syncing)
        if not self._open:  # inside a phase (an optimizer closure) the time is that phase's
            self._intervals.append(("forward_backward", self._cursor, end))
            self._cursor = end
            if last_gradient is not None:
                self._comm_intervals.append((last_gradient, end))

    def around_optimizer_step(self, optimizer: object) -> _Window:
        """Around a synchronising ``optimizer.step()``; the step ends once every optimizer stepped."""
        self._stepping = id(optimizer)
        return self._optimizer_window

    def _optimizer_started(self) -> None:
        if self._stepping in self._stepped:  # stepped again before the others: the step ended before
            self._close_step(self._mark())
        self._enter("optimizer")

    def _optimizer_finished(self) -> None:
        end = self._exit("optimizer")
        self._stepped.add(self._stepping)
        if len(self._stepped) >= len(self._optimizers()):
            self._close_step(end)

    def checkpoint(self) -> _Window:
        """Around ``save_state`` / ``wait_for_checkpoint``."""
        return self._checkpoint_window

    # -- phases ------------------------------------------------------------------------------------
    def _begin(self, mark: Any) -> None:
        self._step_start = self._cursor = mark
        if self._flops is not None:
            self._flops.arm()

    def _enter(self, phase: str) -> None:
        now = self._mark()
        if self._step_start is None:
            self._begin(now)
        if self._open:  # the enclosing phase pauses while this one runs
            outer = self._open[-1]
            self._intervals.append((outer[0], outer[1], now))
        self._open.append([phase, now])

    def _exit(self, phase: str) -> Any:
        now = self._mark()
        opened = self._open
        for index in range(len(opened) - 1, -1, -1):
            if opened[index][0] == phase:
                self._intervals.append((phase, opened[index][1], now))
                del opened[index]
                break
        if opened:
            opened[-1][1] = now
        self._cursor = now
        return now

    # -- the end of a step -------------------------------------------------------------------------
    def _close_step(self, end: Any) -> None:
        if not self._backwards and self._handed_over is not None:
            # A loop calling loss.backward() itself: count the step's last batch.
            self._counts.add(self._handed_over)
            self._handed_over = None
        if not self._cpu:
            self.clock.wait(end)
        for entry in self._open:  # a phase still running carries over into the next step
            self._intervals.append((entry[0], entry[1], end))
            entry[1] = end
        self._last, self._stats = self._measure(end), None
        self._intervals.clear()
        self._comm_intervals.clear()
        self._counts.reset()
        self._backwards = 0
        self._stepped.clear()
        self._step_start = self._cursor = end
        self.steps += 1
        every = self.config.log_every_n_steps
        if every:
            self._window.append(self._last)
            if self.steps % every == 0:
                self._log_window()

    def _measure(self, end: Any) -> StepTotals:
        phases = {"data": 0.0, "forward_backward": 0.0, "optimizer": 0.0, "checkpoint": 0.0}
        if self._cpu:  # marks are seconds: subtract in place
            for phase, start, stop in self._intervals:
                phases[phase] += stop - start
            seconds = end - self._step_start
            communication = [stop - start for start, stop in self._comm_intervals]
        else:
            elapsed = self.clock.elapsed
            for phase, start, stop in self._intervals:
                phases[phase] += elapsed(start, stop)
            seconds = elapsed(self._step_start, end)
            communication = [elapsed(start, stop) for start, stop in self._comm_intervals]
        counts = self._counts
        return StepTotals(
            steps=1,
            seconds=seconds,
            phases=phases,
            communication=sum(communication) if communication else None,
            batches=counts.batches,
            samples=counts.samples,
            tokens=counts.tokens() if counts.token_sums else None,
            flops=None
            if self._flops is None and self._counted_flops is None
            else self._step_flops(counts.elements),
        )

    def _step_flops(self, elements: int) -> float | None:
        """Model FLOPs of the step: counted on the first step, scaled by input size afterwards."""
        if self._flops is not None and self._flops.end_step(elements):  # this was the counted step
            self._counted_flops = (float(self._flops.flops or 0), elements)
            self._flops = None
            return self._counted_flops[0] or None
        if self._counted_flops is None:
            if self._flops is not None:
                self._flops.arm()  # the step saw no forward of a prepared model: count the next one
            return None
        flops, counted_elements = self._counted_flops
        if elements > 0 and counted_elements > 0:
            return flops * elements / counted_elements
        return flops or None

    def _log_window(self) -> None:
        """Log the figures of the steps since the last log, together."""
        window = self._window
        self._window = []
        if self._logging_active():
            totals = window[0]
            for more in window[1:]:
                totals = totals + more
            self._log(
                figures(totals, num_processes=self.num_processes, peak_flops=self._peak_flops()), self.steps
            )

    def _peak_flops(self) -> float | None:
        if self._peak is _NOT_LOOKED_UP:
            self._peak = self.config.peak_flops
            if self._peak is None:
                param_dtype = next(
                    (p.dtype for m in self._models() for p in m.parameters() if p.is_floating_point()), None
                )
                dtype = compute_dtype_name(self._mixed_precision(), param_dtype)
                self._peak = device_peak_flops(self.device, dtype)
        return self._peak
