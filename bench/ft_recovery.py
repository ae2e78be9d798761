"""A lost machine: the time without progress and the steps redone, live fault tolerance (torchft) against an
elastic restart, on the same model.

    .venv/bin/python bench/ft_recovery.py [--groups 3] [--steps 24] [--kill-at 12] [--every 5] [--repeats 1]

Both kinds run real ``lockstep launch`` jobs of GROUPS processes training the same MLP (``--width`` x
``--layers``, AdamW) on CPU, and lose their last process to SIGKILL right after step KILL_AT:

- **live**: GROUPS launches with ``--fault-tolerance`` (one replica group each) around a torchft lighthouse
  started here (heartbeat timeout 1 s); the survivors keep their processes and step on without the lost group;
- **elastic**: one launch of GROUPS processes (DDP) with ``--max-restarts 1``, saving the state every EVERY
  steps; the launcher stops the survivors, starts every process again and they resume from the newest
  checkpoint.

Measured on process 0's log: the typical step (median before the kill); **stalled**: seconds from the kill to
its first committed step numbered KILL_AT or more (the first the lost process takes no part in; live: once
torchft's quorum has dropped it, elastic: after the restart and the steps redone), and that in steps; **redone**: steps trained again (the
elastic job repeats those since its last checkpoint; live redoes none). The kinds alternate; medians over
REPEATS.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = str(Path(__file__).with_name("_ft_recovery_worker.py"))
LAUNCH = [sys.executable, "-m", "lockstep.cli.main", "launch", "--cpu"]
LIGHTHOUSE = (
    "import time; from torchft.coordination import LighthouseServer; "
    "server = LighthouseServer(bind='127.0.0.1:0', min_replicas={min_replicas}, heartbeat_timeout_ms=1000, "
    "join_timeout_ms=10000); print(server.address(), flush=True); time.sleep(3600)"
)


def _worker_args(mode: str, out: Path, args: argparse.Namespace) -> list[str]:
    sizes = ["--width", str(args.width), "--layers", str(args.layers)]
    return [WORKER, mode, str(out), "--steps", str(args.steps), "--kill-at", str(args.kill_at), *sizes]


def run_live(out: Path, args: argparse.Namespace) -> None:
    code = LIGHTHOUSE.format(min_replicas=args.groups - 1)
    lighthouse = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert lighthouse.stdout is not None
        address = lighthouse.stdout.readline().strip()
        flags = ["--fault-tolerance", "--num-replica-groups", str(args.groups), "--lighthouse", address]
        flags += ["--min-replicas", str(args.groups - 1)]
        jobs = [
            subprocess.Popen(
                [*LAUNCH, *flags, "--replica-group", str(group), *_worker_args("live", out, args)],
                stdout=subprocess.DEVNULL,
                stderr=open(out / f"launch{group}.err", "w"),
            )
            for group in range(args.groups)
        ]
        codes = [job.wait(timeout=600) for job in jobs]
        if any(codes[:-1]):
            raise RuntimeError(
                f"a surviving group failed: {codes}\n{(out / 'launch0.err').read_text()[-3000:]}"
            )
    finally:
        lighthouse.kill()
        lighthouse.wait()


def run_elastic(out: Path, args: argparse.Namespace) -> None:
    flags = ["--num-processes", str(args.groups), "--max-restarts", "1"]
    worker = [*_worker_args("elastic", out, args), "--every", str(args.every)]
    done = subprocess.run([*LAUNCH, *flags, *worker], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"the elastic job failed:\n{done.stderr[-3000:]}")


def measure(out: Path, kill_at: int) -> dict[str, float]:
    killed = float((out / "killed").read_text())
    lines = [json.loads(line) for line in (out / "0.steps").read_text().splitlines()]
    before = [line["t"] for line in lines if line["t"] < killed]
    typical = statistics.median(b - a for a, b in itertools.pairwise(before))
    after = [line for line in lines if line["t"] > killed]
    live = all(line["attempt"] == 0 for line in lines)
    # the first step the lost process never took part in, committed: the run moves on past the failure
    moved = next(line for line in after if line["step"] >= kill_at and line["committed"])
    redone = 0 if live else kill_at - min(line["step"] for line in after)
    stalled = moved["t"] - killed
    return {"step_s": typical, "stalled_s": stalled, "stalled_steps": stalled / typical, "redone": redone}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=3, help="processes (live: replica groups of one)")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--kill-at", type=int, default=12, help="the last process dies after this step")
    parser.add_argument("--every", type=int, default=5, help="elastic: checkpoint every this many steps")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {"live": [], "elastic": []}
    for repeat in range(args.repeats):
        for kind in ("live", "elastic") if repeat % 2 == 0 else ("elastic", "live"):
            out = Path(tempfile.mkdtemp(prefix=f"ft_recovery_{kind}_"))
            try:
                (run_live if kind == "live" else run_elastic)(out, args)
                results[kind].append(measure(out, args.kill_at))
            finally:
                shutil.rmtree(out, ignore_errors=True)
    print(
        f"{args.groups} processes, MLP {args.width}x{args.layers}, the last killed after step {args.kill_at}"
    )
    medians = {
        kind: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for kind, runs in results.items()
    }
    for kind, row in medians.items():
        print(
            f"{kind:8s} step {row['step_s'] * 1000:7.1f} ms   stalled {row['stalled_s']:6.2f} s "
            f"({row['stalled_steps']:6.1f} steps)   redone {row['redone']:.0f}"
        )
    ratio = medians["elastic"]["stalled_s"] / medians["live"]["stalled_s"]
    print(f"elastic / live time without progress: {ratio:.1f}x")
    print(json.dumps({"ft_recovery": medians, "elastic_over_live": ratio}))


if __name__ == "__main__":
    main()
