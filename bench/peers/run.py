"""lockstep against Accelerate, Lightning Fabric and hand-written PyTorch: every comparison in one run.

    bash bench/peers/setup.sh                     # once: bench/peers/.venv with the peers
    bench/peers/run [--quick] [--out bench/results]

Every measure runs the four tools side by side, interleaved in ABBA blocks so the machine's load hits
all alike, and is reported as the ratio to hand-written PyTorch (median of the per-block ratios, with the
quartiles of the blocks); import time as seconds over ``import torch``. Writes
``<out>/peers-<date>.json`` and one PNG chart per measure, then prints the table and the checks (equal
work, exact mid-epoch resume). ``--quick`` shrinks every size, for trying the harness (a few minutes).
``--only checkpoints,resume`` measures only those groups again and replaces their entries in the day's
result file (each entry keeps the load average of its own run), e.g. after a change to one of them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent
sys.path[:0] = [str(HERE), str(BENCH)]

from _torchrun import TORCHRUN, reserved_port, user_env  # noqa: E402
from harness import (  # noqa: E402
    TOOLS,
    equal_work,
    format_table,
    make_result,
    measure,
    validate,
    write_charts,
)

NOOP = str(BENCH / "noop.py")
IMPORTS = {
    "torch": "import torch",
    "lockstep": "from lockstep import Accelerator",
    "accelerate": "from accelerate import Accelerator",
    "fabric": "from lightning_fabric import Fabric",
}
# Tools whose shuffled order is the hand-written loop's: Fabric swaps in a DistributedSampler (seed 0),
# as the hand-written loop does; lockstep and Accelerate shard the batches of one shuffled loader
# (rank r takes batches r, r+N, ...), a different split of the same epoch.
SAME_SHUFFLED_ORDER = {"torch": True, "fabric": True, "lockstep": False, "accelerate": False}


def env() -> dict[str, str]:
    """A user's environment (bytecode caching on, one thread per process) with the workers' imports."""
    path = os.pathsep.join([str(HERE), str(BENCH), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return user_env(PYTHONPATH=path, ACCELERATE_USE_CPU="1")


def load() -> float:
    return os.getloadavg()[0]


def timed_run(command: list[str], **extra: str) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, env={**env(), **extra})
    return time.perf_counter() - started


def json_of(command: list[str]) -> dict:
    completed = subprocess.run(command, env=env(), capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} failed ({completed.returncode}):\n{completed.stderr[-3000:]}"
        )
    return json.loads(completed.stdout.strip().splitlines()[-1])


def interleaved(commands: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    from harness import abba_order

    if repeats > 1:  # a measured run warms the file cache and writes bytecode first; --quick only tries it
        for command in commands.values():
            command()
    samples: dict[str, list[float]] = {tool: [] for tool in commands}
    for order in abba_order(list(commands), repeats):
        for tool in order:
            samples[tool].append(commands[tool]())
    return samples


def bin_of(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


# -- measures --------------------------------------------------------------------------------------------
def measure_import(repeats: int) -> dict:
    before = load()
    commands = {t: (lambda s=s: timed_run([sys.executable, "-c", s])) for t, s in IMPORTS.items()}
    samples = interleaved(commands, repeats)
    return measure("import over `import torch`", "s", samples, kind="delta", load_average=[before, load()])


def measure_launch(repeats: int) -> dict:
    before = load()
    commands = {
        "torch": lambda: timed_run(
            [bin_of("torchrun"), "--nproc_per_node", "2", "--master_port", str(reserved_port()), NOOP]
        ),
        "lockstep": lambda: timed_run([bin_of("lockstep"), "launch", "--num-processes", "2", NOOP]),
        "accelerate": lambda: timed_run(
            [bin_of("accelerate"), "launch", "--cpu", "--num_processes", "2", NOOP], ACCELERATE_USE_CPU="1"
        ),
        "fabric": lambda: timed_run(
            [bin_of("fabric"), "run", "--accelerator", "cpu", "--devices", "2", NOOP]
        ),
    }
    samples = interleaved(commands, repeats)
    notes = {
        "torch": "torchrun --nproc_per_node 2",
        "accelerate": "accelerate launch --cpu --num_processes 2, ACCELERATE_USE_CPU=1",
        "fabric": "fabric run --accelerator cpu --devices 2 (torchrun underneath)",
    }
    return measure("launch 2 processes (no-op)", "s", samples, load_average=[before, load()], notes=notes)


def step_worker(workload: str, blocks: int, steps: int, equal_work_steps: int) -> tuple[dict, dict]:
    before = load()
    command = [sys.executable, *TORCHRUN, "--nproc_per_node", "2", str(HERE / "_step_worker.py")]
    sizes = ["--blocks", str(blocks), "--steps", str(steps), "--equal-work-steps", str(equal_work_steps)]
    raw = json_of([*command, "--workload", workload, *sizes])
    titles = {
        "mlp": "DDP step, MLP (0.4M), 2 processes",
        "transformer": "DDP step, transformer (0.5M), 2 processes",
        "fsdp": "FSDP2 step (4.7M), 2 processes",
    }
    notes, flags = {}, {}
    extra = {"optimizer_steps": raw["steps"], "parameters": raw["parameters"], "flags": flags}
    if raw["bytes"]:
        extra["bytes_per_rank"] = raw["bytes"]
        sharded = raw["bytes"]["torch"]
        for tool, nbytes in raw["bytes"].items():
            if nbytes > 1.05 * sharded:
                notes[tool] = (
                    f"not sharded: {nbytes / 2**20:.1f} MiB per rank against {sharded / 2**20:.1f} MiB for "
                    "hand-written FSDP2 (falls back to DDP on CPU without a word)"
                )
                flags[tool] = "not sharded: DDP"
    milliseconds = {tool: [s * 1e3 for s in values] for tool, values in raw["seconds"].items()}
    entry = measure(
        titles[workload], "ms", milliseconds, load_average=[before, load()], notes=notes, extra=extra
    )
    return entry, raw


def equal_work_checks(workload: str, raw: dict) -> dict:
    in_order = equal_work(raw["equal_work"]["in_order"])
    shuffled_runs = {
        tool: {**run, "same_order": SAME_SHUFFLED_ORDER[tool]}
        for tool, run in raw["equal_work"]["shuffled"].items()
    }
    steps = raw["steps"]
    return {
        "workload": workload,
        "timed_optimizer_steps": steps,
        "timed_steps_equal": len(set(steps.values())) == 1,
        "in_order": in_order,
        "shuffled": equal_work(shuffled_runs),
    }


def measure_checkpoints(params_millions: float, repeats: int) -> dict[str, dict]:
    before = load()
    worker = [sys.executable, str(HERE / "_checkpoint_worker.py")]
    raw = json_of([*worker, "io", "--params-millions", str(params_millions), "--repeats", str(repeats)])
    after = load()
    megabytes = {tool: nbytes / 1e6 for tool, nbytes in raw["bytes"].items()}
    result = {}
    for name, title in (("save", "checkpoint save"), ("load", "checkpoint load")):
        seconds = raw["seconds"][name]
        rates = {t: round(megabytes[t] / (sum(s) / len(s)), 1) for t, s in seconds.items()}
        entry = measure(
            f"{title} ({megabytes['torch']:.0f} MB, time)",
            "s",
            seconds,
            load_average=[before, after],
            extra={"mb_per_s": rates, "megabytes": megabytes},
        )
        result[f"checkpoint_{name}"] = entry
    stalls = {t: s for t, s in raw["seconds"]["async_stall"].items() if s}
    notes = {t: "no asynchronous save" for t in TOOLS if t not in stalls}
    notes["torch"] = "torch.distributed.checkpoint.async_save"
    result["async_stall"] = measure(
        "training stall of an asynchronous save", "s", stalls, load_average=[before, after], notes=notes
    )
    return result


def measure_resume_time(repeats: int) -> dict[str, dict]:
    before = load()
    raw = json_of(
        [sys.executable, str(HERE / "_checkpoint_worker.py"), "resume-time", "--repeats", str(repeats)]
    )
    notes = {
        "torch": "a resumable sampler: the epoch's permutation from seed + epoch, sliced",
        "lockstep": "load_state's saved position (O(1))",
        "accelerate": "skip_first_batches: walks the sampler past the skipped batches",
        "fabric": "no mid-epoch resume documented: iterates past the skipped batches",
    }
    return {
        f"resume_{position}": measure(
            f"resume at batch {int(position):,} of 1,000,000 shuffled samples",
            "s",
            seconds,
            load_average=[before, load()],
            notes=notes,
        )
        for position, seconds in raw.items()
    }


def resume_correctness(stop_at: int) -> dict:
    """Per tool: train uninterrupted; train, stop after ``stop_at`` steps and save; resume in a fresh
    process; compare the final weights."""
    import torch

    worker = [sys.executable, str(HERE / "_checkpoint_worker.py"), "train"]
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for tool in TOOLS:
            full, resumed, folder = (
                root / f"{tool}-full.pt",
                root / f"{tool}-resumed.pt",
                root / f"{tool}-ckpt",
            )
            json_run = [*worker, "--tool", tool]
            for extra in (
                ["--out", str(full)],
                ["--out", str(root / "unused.pt"), "--stop-at", str(stop_at), "--save", str(folder)],
                ["--out", str(resumed), "--resume", str(folder)],
            ):
                subprocess.run([*json_run, *extra], check=True, capture_output=True, env=env())
            a, b = torch.load(full, weights_only=True), torch.load(resumed, weights_only=True)
            diff = max((a[k] - b[k]).abs().max().item() for k in a)
            result[tool] = {"weights_equal": diff == 0.0, "max_abs_diff": diff}
    return {"stop_at_step": stop_at, "of_steps": 40, "tools": result}


# -- the run ---------------------------------------------------------------------------------------------
def versions() -> dict[str, str]:
    import accelerate
    import lightning_fabric
    import torch

    import lockstep

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lockstep": lockstep.__version__,
        "accelerate": accelerate.__version__,
        "lightning_fabric": lightning_fabric.__version__,
    }


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.machine()


def machine() -> dict:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "processor": cpu_model(),
        "gpu": "none",
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


# repeats of import and launch; blocks x steps of each step measure; steps of each equal-work run;
# checkpoint size (M parameters), repeats of the checkpoint and resume-time measures
SIZES = {
    "full": {
        "repeats": 7,
        "ddp": (20, 40),
        "transformer": (20, 20),
        "fsdp": (10, 10),
        "equal_work_steps": 20,
        "params": 25.0,
        "io": 5,
        "resume": 7,
    },
    "quick": {
        "repeats": 1,
        "ddp": (2, 5),
        "transformer": (2, 3),
        "fsdp": (2, 2),
        "equal_work_steps": 4,
        "params": 1.0,
        "io": 2,
        "resume": 2,
    },
}


GROUPS = ("import", "launch", "steps", "checkpoints", "resume")
"""The measures ``--only`` can run again, in the order a whole run takes them."""


def run(sizes: dict, log: Callable[[str], None], groups: tuple[str, ...] = GROUPS) -> tuple[dict, dict]:
    measures: dict = {}
    checks: dict = {}
    if "import" in groups:
        log("import")
        measures["import"] = measure_import(sizes["repeats"])
    if "launch" in groups:
        log("launch")
        measures["launch"] = measure_launch(sizes["repeats"])
    if "steps" in groups:
        checks["equal_work"] = {}
        for workload, key in (("mlp", "ddp"), ("transformer", "transformer"), ("fsdp", "fsdp")):
            log(f"step time: {workload}")
            name = "fsdp" if workload == "fsdp" else f"ddp_{workload}"
            measures[name], raw = step_worker(workload, *sizes[key], sizes["equal_work_steps"])
            checks["equal_work"][name] = equal_work_checks(workload, raw)
    if "checkpoints" in groups:
        log("checkpoints")
        measures.update(measure_checkpoints(sizes["params"], sizes["io"]))
    if "resume" in groups:
        log("resume time")
        measures.update(measure_resume_time(sizes["resume"]))
        log("mid-epoch resume correctness")
        checks["resume_correctness"] = resume_correctness(stop_at=25)
    return measures, checks


def parse_groups(text: str) -> tuple[str, ...]:
    """``--only``'s comma-separated groups, refused by name when one is unknown."""
    groups = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [group for group in groups if group not in GROUPS]
    if unknown or not groups:
        raise SystemExit(
            f"bench/peers/run: --only {text!r} names {unknown or 'no group'}; the groups are {', '.join(GROUPS)}."
        )
    return groups


def merged_into(path: Path, measures: dict, checks: dict, versions_found: dict) -> dict:
    """The result file at ``path`` with ``measures`` and ``checks`` replacing its entries of the same name."""
    if not path.is_file():
        raise SystemExit(
            f"bench/peers/run: --only replaces entries of {path}, which does not exist; run all first."
        )
    result = json.loads(path.read_text())
    validate(result)
    if result["versions"] != versions_found:
        raise SystemExit(
            f"bench/peers/run: {path} was measured with {result['versions']}, this environment has "
            f"{versions_found}; measure everything again instead of mixing them."
        )
    result["measures"].update(measures)
    for name, check in checks.items():
        if isinstance(check, dict) and isinstance(result["checks"].get(name), dict):
            result["checks"][name].update(check)
        else:
            result["checks"][name] = check
    remeasured = result["machine"].setdefault("remeasured", {})
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    remeasured.update(dict.fromkeys(measures, when))
    validate(result)
    return result


def print_checks(checks: dict) -> None:
    for name, check in checks["equal_work"].items():
        steps = "equal" if check["timed_steps_equal"] else f"DIFFER {check['timed_optimizer_steps']}"
        diffs = ", ".join(f"{t} {v['loss_diff']:.1e}" for t, v in check["in_order"]["tools"].items())
        print(f"equal work, {name}: optimizer steps {steps}; final loss diff (data in order) {diffs}")
        shuffled = ", ".join(
            f"{t} {v['loss_diff']:.1e}{'' if v['same_order'] else ' (other order)'}"
            for t, v in check["shuffled"]["tools"].items()
        )
        print(f"  shuffled: {shuffled}")
    for tool, figures in checks["resume_correctness"]["tools"].items():
        verdict = "yes" if figures["weights_equal"] else "no"
        print(f"mid-epoch resume exact, {tool}: {verdict} (max diff {figures['max_abs_diff']:.2e})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for trying the harness")
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument(
        "--redraw", type=Path, metavar="JSON", help="only redraw the charts and table of a result"
    )
    parser.add_argument(
        "--only", metavar="GROUPS", help=f"measure only these ({','.join(GROUPS)}) into the day's result file"
    )
    args = parser.parse_args()
    groups = parse_groups(args.only) if args.only else GROUPS
    if args.redraw:
        result = json.loads(args.redraw.read_text())
        validate(result)
        charts = write_charts(result, args.redraw.parent, args.redraw.stem)
        print(format_table(result))
        print(f"redrew {len(charts)} charts of {args.redraw}")
        return
    try:
        found = versions()
    except ImportError as error:
        sys.exit(f"bench/peers/run: {error}. Create the peers' environment first: bash bench/peers/setup.sh")
    started = time.perf_counter()

    def log(what: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s, load {load():.1f}] {what}", flush=True)

    size = "quick" if args.quick else "full"
    stem = f"peers-{args.date}" + ("-quick" if args.quick else "")
    path = args.out / f"{stem}.json"
    if args.only and not path.is_file():
        merged_into(path, {}, {}, found)  # refuses before measuring anything
    info = machine()
    measures, checks = run(SIZES[size], log, groups)
    info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    info["seconds"] = round(time.perf_counter() - started)
    if args.only:
        result = merged_into(path, measures, checks, found)
    else:
        result = make_result(
            date=args.date,
            machine=info,
            versions=found,
            settings={"size": size, **SIZES[size]},
            measures=measures,
            checks=checks,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    charts = write_charts(result, args.out, stem)
    print(format_table(result))
    print_checks(result["checks"])
    print(f"wrote {path} and {len(charts)} charts in {info['seconds']} s")


if __name__ == "__main__":
    main()
