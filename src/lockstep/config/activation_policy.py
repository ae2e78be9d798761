"""The vocabulary of activation memory policies (no torch): names, parsing, which blocks a policy wraps.

What each policy does, and how it is applied, is in :mod:`lockstep.memory.activation_policy`.

Example:
    >>> policy = parse_activation_policy("every_2", owner="activation_checkpointing")
    >>> policy.name, [policy.checkpoints(i) for i in range(4)]
    ('every_2', [False, True, False, True])
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

POLICIES = ("none", "full", "every_<k>", "op", "offload")
"""The policy names, as errors and ``--help`` list them."""

_EVERY = re.compile(r"^every_(\d+)$")
_ALIASES = {"false": "none", "no": "none", "off": "none", "true": "full", "yes": "full", "on": "full"}
_ALIASES |= {"selective": "op", "selective_op": "op", "cpu_offload": "offload"}


@dataclass(frozen=True)
class ActivationPolicy:
    """One activation memory policy (see the module docstring); build it with :func:`parse_activation_policy`."""

    mode: str
    """``none``, ``full``, ``every``, ``op`` or ``offload``."""
    every: int = 1
    """For ``every``: checkpoint every k-th block."""

    @property
    def name(self) -> str:
        return f"every_{self.every}" if self.mode == "every" else self.mode

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def checkpoints(self, index: int) -> bool:
        """Whether the block at ``index`` (0-based, in model order) is wrapped by this policy."""
        if self.mode == "none":
            return False
        return self.mode != "every" or (index + 1) % self.every == 0


def parse_activation_policy(value: Any, *, owner: str) -> ActivationPolicy:
    """A policy from ``True``/``False``/``None``, a policy name, or an :class:`ActivationPolicy`.

    Raises:
        ValueError: an unknown name or a bad ``every_<k>``; ``owner`` (how the user spelled the setting)
            and the valid policies are in the message.
    """
    if isinstance(value, ActivationPolicy):
        return value
    if value is None or isinstance(value, bool):
        return ActivationPolicy("full" if value else "none")
    text = value.strip().lower().replace("-", "_") if isinstance(value, str) else None
    text = _ALIASES.get(text, text) if text is not None else None
    if text in ("none", "full", "op", "offload"):
        return ActivationPolicy(text)
    match = _EVERY.match(text or "")
    if match and int(match.group(1)) >= 1:
        every = int(match.group(1))
        return ActivationPolicy("full") if every == 1 else ActivationPolicy("every", every)
    raise ValueError(
        f"{owner}={value!r} is not an activation policy: use one of {', '.join(POLICIES)} (k >= 1: "
        "checkpoint every k-th block), or True (= full) / False (= none)."
    )
