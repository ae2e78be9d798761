"""Every test process that holds a process group ends it before the interpreter exits (issue 44, item 7):
a gloo group alive at exit sometimes aborts a finished process (SIGABRT, pytorch/pytorch#190489).

Who ends it: lockstep, in a script its ``Accelerator``, ``PartialState`` or ``Trainer`` runs in (it makes
or adopts the group and tears it down at exit); ``run_distributed``'s workers, which end it and leave with
``os._exit``; the script itself with ``destroy_process_group()``; and for a script or module lockstep does
not own under torchrun, ``tests/helpers/close_group_at_exit.py`` as the entry point.
"""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
_ENDS_ITS_GROUP = ("destroy_process_group", "Accelerator(", "PartialState(", "Trainer(", "run_distributed")


def test_every_file_that_makes_a_group_has_it_ended():
    makers = {
        path.relative_to(TESTS).as_posix(): path.read_text(encoding="utf-8")
        for path in sorted(TESTS.rglob("*.py"))
        if not path.relative_to(TESTS).as_posix().startswith(("e2e/trainer_scripts/", "e2e/no_trainer/"))
    }
    makers = {name: text for name, text in makers.items() if "init_process_group(" in text}
    assert makers  # the check looks where groups are made
    unended = [name for name, text in makers.items() if not any(end in text for end in _ENDS_ITS_GROUP)]
    assert unended == []


def test_torchrun_runs_of_scripts_lockstep_does_not_own_go_through_the_runner():
    """transformers.Trainer's and Accelerate's runs under torchrun: the group is theirs, so the runner ends it."""
    for name in ("helpers/reference.py", "trainer/test_default_parity.py", "trainer/test_seq2seq.py"):
        text = (TESTS / name).read_text(encoding="utf-8")
        assert "torch.distributed.run" in text and "RUNNER" in text, name
    trainer_scripts = (TESTS / "e2e" / "test_trainer_scripts.py").read_text(encoding="utf-8")
    assert 'CLOSE_GROUP_AT_EXIT)] if which == "transformers"' in trainer_scripts
