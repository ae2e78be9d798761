"""Every flag of ``accelerate launch`` (1.15) is understood by ``lockstep launch``, in both spellings.

The list, with each flag's status, is ``src/lockstep/cli/accelerate_launch_flags.txt``: implemented and
accepted flags parse into settings; unsupported ones exit with code 2 and one line naming the flag as typed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

import lockstep.cli
from lockstep.cli.launch_flags import given_flags
from lockstep.cli.main import build_parser, main

FLAG_FILE = Path(lockstep.cli.__file__).parent / "accelerate_launch_flags.txt"
STATUSES = ("implemented", "accepted", "unsupported")


@dataclass(frozen=True)
class ListedFlag:
    spellings: tuple[str, ...]
    value: str | None
    status: str
    section: str


def _listed() -> list[ListedFlag]:
    flags, section = [], ""
    for line in FLAG_FILE.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            section = line[3:].split(" (")[0]
        elif line.strip() and not line.startswith("#"):
            names, value, status, _note = (part.strip() for part in line.split(" | "))
            first, *short = names.split()
            dashed = "--" + first[2:].replace("_", "-")
            spellings = tuple(dict.fromkeys((first, dashed, *short)))
            flags.append(ListedFlag(spellings, None if value == "-" else value, status, section))
    return flags


LISTED = _listed()
CASES = [
    pytest.param(flag, spelling, id=spelling)
    for flag in LISTED
    for spelling in flag.spellings
    if spelling not in ("--help", "-h")
]


def _argv(flag: ListedFlag, spelling: str) -> list[str]:
    return ["launch", spelling, *([flag.value] if flag.value is not None else []), "train.py"]


def test_the_list_holds_accelerate_1_15s_124_flags_and_their_statuses():
    current = [flag for flag in LISTED if flag.section == "accelerate 1.15"]
    assert len(current) == 124
    assert {flag.status for flag in LISTED} <= set(STATUSES)
    counts = {status: sum(flag.status == status for flag in current) for status in STATUSES}
    assert counts == {"implemented": 61, "accepted": 9, "unsupported": 54}
    assert len({flag.spellings[0] for flag in LISTED}) == len(LISTED)


def test_every_launch_flag_of_lockstep_is_on_the_list():
    parser = build_parser()
    launch = next(
        choice
        for action in parser._actions
        if hasattr(action, "choices") and isinstance(action.choices, dict)
        for name, choice in action.choices.items()
        if name == "launch"
    )
    options = {option for action in launch._actions for option in action.option_strings}
    listed = {spelling for flag in LISTED for spelling in flag.spellings}
    assert options == listed


@pytest.mark.parametrize(
    ("flag", "spelling"), [case for case in CASES if case.values[0].status != "unsupported"]
)
def test_implemented_and_accepted_flags_parse_into_settings(flag, spelling):
    args = build_parser().parse_args(_argv(flag, spelling))
    assert args.target == "train.py" and args.script_args == []
    given_flags(args)  # raises for a refused flag or a value its check rejects


@pytest.mark.parametrize(
    ("flag", "spelling"), [case for case in CASES if case.values[0].status == "unsupported"]
)
def test_unsupported_flags_are_one_line_naming_the_flag_and_exit_code_2(flag, spelling, capsys):
    assert main(_argv(flag, spelling)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"lockstep launch: error: {spelling} is not supported")


def test_help_is_a_flag_and_names_the_refused_families(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["launch", "-h"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--num_cpu_threads_per_process NUM_CPU_THREADS_PER_PROCESS" in out
    assert "TPUs, SageMaker, Megatron-LM, FP8, sequence parallelism and mpirun are accepted" in out
    assert "--tpu" not in out  # refused flags are hidden from the list
