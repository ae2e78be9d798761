"""Cost of the hang diagnosis's collective record on a collective-heavy loop.

Two CPU processes under torchrun run a loop that does nothing but communicate: each step is a
``torch.distributed.all_reduce`` of 16 floats, a lockstep ``reduce`` of 16 floats and, every 10 steps, a
``barrier``. Blocks of steps alternate (ABBA) between the record installed and not installed, so both
see the same machine load; the ratio is the median of the per-block ratios (with / without), in wall
time and in the CPU time of the training thread (which a loaded machine disturbs less). Then,
in one process, the recording wrapper around a do-nothing function gives the cost per call, and
``note_step`` the cost per optimizer step. Target: ratio <= 1.02 (negligible outside a hang).

    .venv/bin/python bench/collective_log_overhead.py [--blocks 20 --steps 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from _torchrun import run_script


def worker(blocks: int, steps: int) -> None:
    import torch
    import torch.distributed as dist

    from lockstep import collectives
    from lockstep.diagnostics import collective_log
    from lockstep.state import PartialState

    state = PartialState()
    log = collective_log.CollectiveLog(64)
    tensor = torch.ones(16)

    def run_block() -> tuple[float, float]:
        """Wall and CPU (this thread) seconds per step."""
        wall, cpu = time.perf_counter(), time.thread_time()
        for step in range(steps):
            dist.all_reduce(tensor)
            collectives.reduce(tensor, reduction="sum")
            if step % 10 == 0:
                dist.barrier()
        return (time.perf_counter() - wall) / steps, (time.thread_time() - cpu) / steps

    run_block()  # warm-up
    samples: dict[str, list[float]] = {"ratio": [], "cpu_ratio": [], "with": [], "without": []}
    for block in range(blocks):
        order = (True, False) if block % 2 == 0 else (False, True)
        times = {}
        for recorded in order:
            if recorded:
                collective_log.install(log)
            else:
                collective_log.uninstall()
            times[recorded] = run_block()
        collective_log.uninstall()
        samples["ratio"].append(times[True][0] / times[False][0])
        samples["cpu_ratio"].append(times[True][1] / times[False][1])
        samples["with"].append(times[True][0])
        samples["without"].append(times[False][0])
    if state.is_main_process:
        print(json.dumps({name: statistics.median(values) for name, values in samples.items()}), flush=True)
    state.destroy_process_group()


def per_call_costs(calls: int = 200_000) -> dict[str, float]:
    """Microseconds per recorded call around a do-nothing function, and per ``note_step``."""
    import torch

    from lockstep.diagnostics import collective_log
    from lockstep.diagnostics.settings import WatchdogPlan
    from lockstep.diagnostics.watchdog import HangWatchdog

    def all_reduce(
        tensor: torch.Tensor, op: object = None, group: object = None, async_op: bool = False
    ) -> None:
        return None

    log = collective_log.CollectiveLog(64)
    recorded = collective_log._wrap("all_reduce", all_reduce, log)
    tensor = torch.ones(16)
    results = {}
    for name, function in (("bare", all_reduce), ("recorded", recorded)):
        started = time.perf_counter()
        for _ in range(calls):
            function(tensor)
        results[name] = (time.perf_counter() - started) / calls * 1e6
    plan = WatchdogPlan(
        timeout=None, timeout_multiplier=20, min_timeout=900, history=64, dump_dir="/tmp", report_grace=1
    )
    watchdog = HangWatchdog(plan, rank=0, world_size=1, exchange=None)
    started = time.perf_counter()
    for _ in range(calls):
        watchdog.note_step()
    results["note_step"] = (time.perf_counter() - started) / calls * 1e6
    return {
        "record_us_per_call": results["recorded"] - results["bare"],
        "note_step_us": results["note_step"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.blocks, args.steps)
        return
    loop = run_script(__file__, "--worker", "--blocks", str(args.blocks), "--steps", str(args.steps))
    costs = per_call_costs()
    print(
        f"collective-heavy loop, 2 gloo processes: {loop['without'] * 1e3:.3f} ms/step without the record, "
        f"{loop['with'] * 1e3:.3f} ms/step with it; wall ratio {loop['ratio']:.3f} (target <= 1.02), "
        f"CPU-time ratio {loop['cpu_ratio']:.3f}"
    )
    print(
        f"recording one call: {costs['record_us_per_call']:.2f} us; note_step: {costs['note_step_us']:.2f} us"
    )


if __name__ == "__main__":
    main()
