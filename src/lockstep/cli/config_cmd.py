"""``lockstep config``: write or check the launch config file (Accelerate's ``default_config.yaml``).

- ``lockstep config [--config-file PATH]`` asks a few questions (defaults in brackets; an empty answer or
  the end of input takes the default) and writes the file.
- ``lockstep config default [--mixed-precision ...] [--num-processes N] [--cpu] [--force]`` writes a
  sensible file for this machine without asking.
- ``lockstep config validate FILE`` checks a file and summarizes it in one line.
- ``lockstep config update [--config-file FILE]`` rewrites a file in the current schema, defaults filled in
  (:mod:`lockstep.cli.config_update`).

The file goes to ``--config-file``, else ``$LOCKSTEP_HOME/default_config.yaml`` (see
:func:`lockstep.config.file.default_config_path`). ``lockstep launch`` reads the same file.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from lockstep.cli._errors import UsageError, warnings_as_lines
from lockstep.cli.config_update import register_update
from lockstep.cli.explain import register_explain
from lockstep.config.answers import parse_choice, parse_int, parse_text, parse_yes_no
from lockstep.config.backend_specs import backend_specs, spec_for_distributed_type
from lockstep.config.enums import DistributedType, DynamoBackend, PrecisionType
from lockstep.config.file import (
    ClusterConfig,
    ConfigFileError,
    default_config_path,
    load_config_file,
    save_config_file,
)
from lockstep.config.setting_specs import setting_specs
from lockstep.config.topology import data_parallel_type

T = TypeVar("T")

MAX_TRIES = 3
"""How often the wizard asks a question before giving up on bad answers."""
DEFAULT_PORT = 29500


@dataclass(frozen=True)
class MachineKind:
    """An answer to the wizard's first question: how many processes, on which devices."""

    distributed: bool
    """Several processes (the wizard asks about machines and process counts)."""
    cpu: bool
    """The processes train on CPUs."""

    def distributed_type(self, processes: int) -> DistributedType:
        return data_parallel_type(processes=processes if self.distributed else 1, cpu=self.cpu)


MACHINE_KINDS = {
    "no": MachineKind(distributed=False, cpu=False),
    "multi-cpu": MachineKind(distributed=True, cpu=True),
    "multi-gpu": MachineKind(distributed=True, cpu=False),
}
WIZARD_PRECISIONS = ("no", "fp16", "bf16")
WIZARD_DYNAMO_BACKENDS = ("no", "eager", "aot_eager", "inductor")
_DESCRIPTION = """\
Write or check the launch config file (Accelerate's default_config.yaml schema).

  lockstep config                     answer a few questions (Enter takes the [default])
  lockstep config default             write a sensible file for this machine without asking
  lockstep config validate FILE       check a file and summarize it
  lockstep config update              rewrite a file in the current schema, defaults filled in

The file goes to --config-file, else $LOCKSTEP_HOME/default_config.yaml
($XDG_CACHE_HOME/lockstep or ~/.cache/lockstep when LOCKSTEP_HOME is unset)."""


def register(subparsers: Any) -> None:
    """Add ``config`` and its actions (``default``, ``validate``, ``update``, ``explain``) to the parser."""
    parser = subparsers.add_parser(
        "config",
        help="write or check the launch config file (Accelerate's default_config.yaml)",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_file_flag(parser, default=None)
    parser.set_defaults(handler=run_wizard)
    # `dest` is shared with the `explain` action, which is registered elsewhere.
    actions = parser.add_subparsers(dest="config_action", metavar="ACTION")

    default = actions.add_parser("default", help="write a config for this machine without asking")
    _add_config_file_flag(default, default=argparse.SUPPRESS)
    default.add_argument(
        "--mixed-precision",
        "--mixed_precision",
        dest="mixed_precision",
        choices=WIZARD_PRECISIONS,
        default="no",
        help="mixed precision (default: no)",
    )
    default.add_argument(
        "--num-processes",
        "--num_processes",
        dest="num_processes",
        type=int,
        metavar="N",
        help="processes in total (default: the GPUs, else 2 CPU processes on >= 2 cores)",
    )
    default.add_argument("--cpu", action="store_true", help="train on the CPU even if GPUs exist")
    default.add_argument("--force", action="store_true", help="replace an existing file")
    default.set_defaults(handler=run_default)

    validate = actions.add_parser("validate", help="check a config file and summarize it")
    validate.add_argument("file", metavar="FILE", help="the config file to check")
    validate.set_defaults(handler=run_validate)
    register_update(actions)
    register_explain(actions)


def _add_config_file_flag(parser: argparse.ArgumentParser, *, default: Any) -> None:
    # The action's flag uses SUPPRESS so that `config --config-file X default` keeps X.
    parser.add_argument(
        "--config-file",
        "--config_file",
        dest="config_file",
        default=default,
        metavar="PATH",
        help="where to write the file (default: $LOCKSTEP_HOME/default_config.yaml)",
    )


def _target(args: argparse.Namespace) -> Path:
    path = getattr(args, "config_file", None)
    return Path(path) if path else default_config_path()


def _write(config: ClusterConfig, path: Path) -> None:
    existed = path.exists()
    try:
        save_config_file(config, path)
    except OSError as error:
        raise UsageError(f"cannot write {path}: {error.strerror or error}.") from None
    print(f"{'Replaced' if existed else 'Wrote'} {path}: {config.summary()}")


# --- validate ----------------------------------------------------------------------------------------


def run_validate(args: argparse.Namespace) -> int:
    """``lockstep config validate FILE``: exit 0 and a summary, or exit 2 and the problem."""
    try:
        with warnings_as_lines("config"):
            config = load_config_file(args.file)
    except ConfigFileError as error:
        raise UsageError(str(error)) from None
    from lockstep.launcher.settings import resolve

    resolve({}, config, str(args.file))  # what launch checks before starting processes (FSDP, DeepSpeed, ...)
    print(f"{args.file} is valid: {config.summary()}")
    return 0


# --- default -----------------------------------------------------------------------------------------


def _cuda_device_count() -> int:
    import torch  # here, not at the top: the CLI must start fast

    return torch.cuda.device_count()


def detect_config(
    *, mixed_precision: str = "no", num_processes: int | None = None, cpu: bool = False
) -> ClusterConfig:
    """A sensible config for this machine.

    N >= 2 GPUs: MULTI_GPU with N processes; one GPU: NO. Without GPUs (or with ``cpu``): MULTI_CPU with 2
    processes when the machine has >= 2 cores, else NO. ``num_processes`` overrides the count.

    Example:
        >>> detect_config(cpu=True, num_processes=4).distributed_type
        <DistributedType.MULTI_CPU: 'MULTI_CPU'>
    """
    if num_processes is not None and num_processes < 1:
        raise UsageError(f"--num-processes {num_processes} is invalid: it must be >= 1.")
    gpus = 0 if cpu else _cuda_device_count()
    if gpus:
        count = gpus if num_processes is None else num_processes
    else:
        count = (2 if (os.cpu_count() or 1) >= 2 else 1) if num_processes is None else num_processes
    return ClusterConfig(
        distributed_type=data_parallel_type(processes=count, cpu=not gpus),
        num_processes=count,
        use_cpu=cpu or (not gpus and count > 1),
        mixed_precision=PrecisionType.parse(mixed_precision, argument="--mixed-precision"),
    )


def run_default(args: argparse.Namespace) -> int:
    """``lockstep config default``: write :func:`detect_config`'s file; refuse to replace one without --force."""
    path = _target(args)
    if path.exists() and not args.force:
        raise UsageError(
            f"{path} already exists; pass --force to replace it, or --config-file to write elsewhere."
        )
    config = detect_config(
        mixed_precision=args.mixed_precision, num_processes=args.num_processes, cpu=args.cpu
    )
    _write(config, path)
    return 0


# --- the wizard --------------------------------------------------------------------------------------


class _Prompter:
    """Asks questions with ``input()``; an empty answer takes the default, end of input takes all defaults."""

    def __init__(self) -> None:
        self.at_end = False

    def _read(self, prompt: str) -> str:
        if self.at_end:
            print(prompt)
            return ""
        try:
            return input(prompt).strip()
        except EOFError:
            self.at_end = True
            print()
            return ""

    def ask(self, question: str, default: str, parse: Callable[[str], T]) -> T:
        """Ask until ``parse`` accepts the answer (at most :data:`MAX_TRIES` times)."""
        answer = ""
        for _ in range(MAX_TRIES):
            answer = self._read(f"{question} [{default}]: ") or default
            try:
                return parse(answer)
            except ValueError as error:
                if self.at_end:  # the default itself is bad; asking again cannot help
                    break
                print(f"  {error} Try again.")
        raise UsageError(f"no valid answer to {question!r} after {MAX_TRIES} tries (last: {answer!r}).")


def _ask_machines(prompter: _Prompter) -> dict[str, Any]:
    machines = prompter.ask("How many machines will you use?", "1", parse_int(1))
    if machines == 1:
        return {"num_machines": 1}
    return {
        "num_machines": machines,
        "machine_rank": prompter.ask(
            f"Rank of this machine (0 to {machines - 1})?", "0", parse_int(0, machines - 1)
        ),
        "main_process_ip": prompter.ask("IP address of the machine of rank 0?", "none", parse_text),
        "main_process_port": prompter.ask(
            "Port of the rendezvous on that machine?", str(DEFAULT_PORT), parse_int(1, 65535)
        ),
        "rdzv_backend": prompter.ask(
            "Rendezvous backend (static, c10d)?", "static", parse_choice(("static", "c10d"))
        ),
        "same_network": prompter.ask(
            "Are all machines on the same local network (yes/no)?", "yes", parse_yes_no
        ),
    }


def _ask_num_processes(prompter: _Prompter, kind: MachineKind, machines: int) -> int:
    per_machine = 2 if kind.cpu else max(2, _cuda_device_count())
    unit = "CPU processes" if kind.cpu else "GPU processes"

    def parse(answer: str) -> int:
        number = parse_int(1)(answer)
        if number % machines:
            raise ValueError(f"{number} is not a multiple of the {machines} machines.")
        return number

    return prompter.ask(f"How many {unit} in total, on all machines?", str(per_machine * machines), parse)


def _ask_sharding(prompter: _Prompter, processes: int) -> dict[str, Any]:
    """Whether to shard the model: with a registered backend that has questions (FSDP, DeepSpeed: those
    Accelerate's wizard asks), or with a setting group that has (the device mesh, ``ParallelismConfig``:
    tensor/context parallel, FSDP, HSDP sizes)."""
    offered = {
        spec.name: spec for spec in backend_specs() if spec.wizard is not None and spec.distributed_types
    }
    groups = {spec.name: spec for spec in setting_specs() if spec.questions is not None}
    names = ", ".join([*offered, *(f"{name}: {spec.title or name} sizes" for name, spec in groups.items())])
    sharding = prompter.ask(f"Shard the model (no, {names})?", "no", parse_choice(("no", *offered, *groups)))
    if sharding == "no":
        return {}
    if sharding in groups:
        group = groups[sharding]
        assert group.questions is not None and group.config_section is not None
        return {group.config_section: group.questions(prompter.ask, processes)}
    spec = offered[sharding]
    assert spec.wizard is not None and spec.config_section is not None
    return {"distributed_type": spec.distributed_types[0], spec.config_section: spec.wizard(prompter.ask)}


def _ask_config(prompter: _Prompter) -> ClusterConfig:
    """The wizard's questions, in order; returns the config the answers describe."""
    kind = MACHINE_KINDS[
        prompter.ask(
            "Which kind of machine are you using (0: no distributed training, 1: multi-CPU, 2: multi-GPU)?",
            "no",
            parse_choice(tuple(MACHINE_KINDS)),
        )
    ]
    settings: dict[str, Any] = {"distributed_type": kind.distributed_type(processes=1), "num_processes": 1}
    if kind.distributed:
        settings.update(_ask_machines(prompter))
        settings["num_processes"] = _ask_num_processes(prompter, kind, settings["num_machines"])
        settings["distributed_type"] = kind.distributed_type(processes=2)  # data parallel, whatever the count
        settings["use_cpu"] = kind.cpu
        settings.update(_ask_sharding(prompter, settings["num_processes"]))
    else:
        settings["use_cpu"] = prompter.ask(
            "Train on the CPU only, even if a GPU is present (yes/no)?", "no", parse_yes_no
        )
    settings["mixed_precision"] = prompter.ask(
        "Mixed precision (no, fp16, bf16)?", "no", parse_choice(WIZARD_PRECISIONS)
    )
    steps = prompter.ask("Gradient accumulation steps?", "1", parse_int(1))
    backend = spec_for_distributed_type(settings.get("distributed_type"))
    if backend is not None and "gradient_accumulation_steps" in backend.section_keys:
        # a backend whose own section holds the steps (DeepSpeed): where Accelerate's wizard writes them
        settings[backend.config_section]["gradient_accumulation_steps"] = steps
    else:
        settings["gradient_accumulation_steps"] = (
            None if steps == 1 else steps
        )  # unset keeps Accelerate's schema
    backend = prompter.ask(
        "torch.compile backend (no, eager, aot_eager, inductor)?", "no", parse_choice(WIZARD_DYNAMO_BACKENDS)
    )
    if backend != "no":
        settings["dynamo_config"] = {"dynamo_backend": DynamoBackend.parse(backend, argument="backend").name}
    return ClusterConfig(**settings)


def run_wizard(args: argparse.Namespace) -> int:
    """``lockstep config``: ask the questions, then write the file."""
    path = _target(args)
    print(f"lockstep config: answering writes {path}. Press Enter to take the [default].")
    try:
        config = _ask_config(_Prompter())
    except KeyboardInterrupt:
        print("\nlockstep config: stopped; nothing was written.", file=sys.stderr)
        return 130
    _write(config, path)
    return 0
