"""A layer written outside ``src/``, installed through its entry point (``lockstep.layers``) by
tests/e2e/test_layer_plugin.py: it counts the committed steps and vetoes one.

Its whole vocabulary is declared here and nowhere in lockstep: the ``step_veto_config`` config-file section
with its keys ``veto_step`` and ``veto_report``, the launch switch ``--step-veto`` and the flags
``--veto-step``/``--veto-report`` (derived from the key table), the ``Accelerator(step_veto=StepVeto(...))``
keyword and the ``TrainingArguments(step_veto={...})`` field. Its step hook answers the commit question: the
``veto_step``-th synchronising step is discarded, every other one applied; each rank appends one line per
step to ``veto_report`` (``rank step applied``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lockstep.config import checks
from lockstep.config.keys import SettingKey
from lockstep.step_hooks import LayerSpec, StepHook


@dataclass
class StepVeto:
    """The layer's config: which committed step to discard (from 1; 0: none), and where to report."""

    veto_step: int = 0
    report: str | None = None


class VetoOneStep(StepHook):
    """Counts the synchronising steps and says no to the ``veto_step``-th."""

    def __init__(self, config: StepVeto, rank: int) -> None:
        self.config, self.rank, self.steps = config, rank, 0

    def commit(self, optimizer: object) -> bool:
        self.steps += 1
        applied = self.steps != self.config.veto_step
        if self.config.report:
            with Path(self.config.report).open("a") as report:
                report.write(f"{self.rank} {self.steps} {applied}\n")
        return applied


def build_hooks(config: StepVeto, accelerator: Any) -> list[StepHook]:
    return [VetoOneStep(config, accelerator.process_index)]


KEYS = (
    SettingKey(
        key="veto_step",
        field="veto_step",
        check=checks.int_range(0),
        help="the synchronising step to discard, from 1 (0: none)",
        flag=True,
    ),
    SettingKey(
        key="veto_report",
        field="report",
        check=checks.string,
        help="a file each rank appends 'rank step applied' to",
        flag=True,
    ),
)


def from_section(section: dict[str, Any]) -> StepVeto:
    return StepVeto(veto_step=int(section.get("veto_step", 0)), report=section.get("veto_report"))


def check_section(section: dict[str, Any], launch: Any) -> None:
    if not section.get("veto_step"):
        raise ValueError("--step-veto needs --veto-step N (the synchronising step to discard, from 1).")


SPEC = LayerSpec(
    name="step_veto",
    summary="count the committed steps and veto one (a test plugin)",
    title="step veto",
    plugin_type="tests.plugins.step_veto:StepVeto",
    accelerator_argument="step_veto",
    trainer_argument="step_veto",
    config_section="step_veto_config",
    keys=KEYS,
    enable_flag="step_veto",
    check_section=check_section,
    plugin_from_section=from_section,
    step_hooks=build_hooks,
)
