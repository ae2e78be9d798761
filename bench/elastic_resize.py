"""Lose a machine: the time to the first step on fewer processes (restart + resharded load), against a restart
on the same number.

    .venv/bin/python bench/elastic_resize.py [--processes 3] [--resized 2] [--repeats 1]

Each cycle runs a real ``lockstep launch`` job on PROCESSES processes: an FSDP2 MLP of about 300 MB (77M
float32 parameters) with AdamW takes one step and saves a sharded checkpoint (model and both moments, about
925 MB), then rank 1 kills itself with SIGKILL, standing for the lost machine. As soon as that job has ended
(the launcher saw the loss and stopped the others), a new job resumes from the checkpoint with ``load_state``
and takes one step: on PROCESSES processes (the same size) or on RESIZED (torch.distributed.checkpoint
reshards the model and optimizer). The two kinds of cycle alternate (which goes first alternates too),
side by side in one run, and the
medians are printed with their phases and the ratios resized / same: to the end of the load (restart +
resharded load), and to the end of the first step (which also depends on how many processes share the
machine's cores).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = str(Path(__file__).with_name("_elastic_resize_worker.py"))
PHASES = ("stop", "start", "prepare", "load", "first_step")


def _launch(processes: int, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "lockstep.cli.main", "launch", "--num-processes", str(processes)]
    return subprocess.run([*command, WORKER, *args], capture_output=True, text=True, timeout=900)


def cycle(saved_on: int, resumed_on: int, width: int, layers: int) -> dict[str, float]:
    """One lost machine and the restart; returns seconds per phase from the kill to the first step."""
    root = Path(tempfile.mkdtemp(prefix="elastic_resize_"))
    try:
        checkpoint, killed, times = str(root / "ckpt"), root / "killed.json", root / "times.json"
        sizes = ["--width", str(width), "--layers", str(layers)]
        lost = _launch(saved_on, "save", checkpoint, str(killed), *sizes)
        stopped = time.time()
        if lost.returncode == 0 or not killed.exists():
            raise RuntimeError(f"the first job did not lose its rank 1:\n{lost.stderr[-3000:]}")
        relaunched = time.time()
        resumed = _launch(resumed_on, "resume", checkpoint, str(times), *sizes)
        if resumed.returncode != 0:
            raise RuntimeError(f"the resumed job failed:\n{resumed.stderr[-3000:]}")
        t = json.loads(times.read_text())
        lost_at = json.loads(killed.read_text())["killed"]
        phases = {
            "stop": stopped - lost_at,  # the launcher notices the lost rank and stops the others
            "start": t["started"] - relaunched,  # a new launch, imports
            "prepare": t["prepared"] - t["started"],  # process group, model, FSDP2
            "load": t["loaded"] - t["prepared"],  # load_state (resharded when the size changed)
            "first_step": t["first_step"] - t["loaded"],
        }
        phases["total"] = t["first_step"] - lost_at
        return phases
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--processes", type=int, default=3, help="processes of the job that loses one")
    parser.add_argument("--resized", type=int, default=2, help="processes of the resumed job after the loss")
    parser.add_argument("--repeats", type=int, default=1, help="cycles of each kind (alternating)")
    parser.add_argument("--width", type=int, default=3584, help="width of each Linear layer")
    parser.add_argument("--layers", type=int, default=6, help="Linear layers (6 x 3584^2: 77M parameters)")
    options = parser.parse_args()
    params = options.layers * (options.width**2 + options.width)
    print(f"FSDP2 MLP of {params / 1e6:.1f}M parameters ({params * 4 / 1e6:.0f} MB), AdamW; ", end="")
    print(f"lost one of {options.processes} processes; medians of {options.repeats} cycle(s) each")
    kinds = {"same": options.processes, "resized": options.resized}
    runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    for repeat in range(options.repeats):
        order = list(kinds.items()) if repeat % 2 == 0 else list(kinds.items())[::-1]  # neither always first
        for kind, resumed_on in order:
            runs[kind].append(cycle(options.processes, resumed_on, options.width, options.layers))
    medians = {
        kind: {phase: statistics.median(r[phase] for r in results) for phase in (*PHASES, "total")}
        for kind, results in runs.items()
    }
    print(f"{'restart on':<16}" + "".join(f"{phase:>12}" for phase in (*PHASES, "total")))
    for kind, resumed_on in kinds.items():
        label = f"{resumed_on} ({kind})"
        print(f"{label:<16}" + "".join(f"{medians[kind][phase]:>11.2f}s" for phase in (*PHASES, "total")))

    def ratio(*phases: str) -> float:
        return sum(medians["resized"][p] for p in phases) / sum(medians["same"][p] for p in phases)

    print(f"resized / same: lost machine -> loaded (restart + load) {ratio(*PHASES[:4]):.2f}; ", end="")
    print(f"-> first step {ratio('total'):.2f}; load_state alone {ratio('load'):.2f}")


if __name__ == "__main__":
    main()
