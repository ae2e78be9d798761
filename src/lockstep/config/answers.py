"""Parsers of the config wizard's answers, shared by ``lockstep config`` and the backends' own questions.

Each parser turns the typed text into a value or raises ``ValueError`` saying what is wrong (the wizard
prints it and asks again). A backend's spec asks its questions through an :data:`Ask` function, so the
questions live with the backend and the prompting with the command line.

This module must not import torch.

Example:
    >>> parse_int(0, 3)("2"), parse_yes_no("Yes"), parse_text("none"), parse_choice(("no", "cpu"))("1")
    (2, True, None, 'cpu')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

Ask = Callable[[str, str, Callable[[str], Any]], Any]
"""``ask(question, default, parse)``: the parsed answer (the wizard asks again until ``parse`` accepts)."""


def parse_choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    """One of ``choices``, by name (``-`` and ``_`` alike, any case) or by position."""

    def parse(answer: str) -> str:
        text = answer.strip().lower().replace("_", "-")
        for index, choice in enumerate(choices):
            if text in (choice.replace("_", "-"), str(index)):
                return choice
        raise ValueError(f"{answer!r} is not one of: {', '.join(choices)}.")

    return parse


def parse_int(low: int, high: int | None = None) -> Callable[[str], int]:
    """A whole number from ``low`` to ``high`` (no upper bound when None)."""

    def parse(answer: str) -> int:
        try:
            number = int(answer)
        except ValueError:
            raise ValueError(f"{answer!r} is not a whole number.") from None
        if number < low or (high is not None and number > high):
            bounds = f">= {low}" if high is None else f"from {low} to {high}"
            raise ValueError(f"{number} is out of range: it must be {bounds}.")
        return number

    return parse


def parse_yes_no(answer: str) -> bool:
    text = answer.strip().lower()
    if text in ("y", "yes", "true", "1"):
        return True
    if text in ("n", "no", "false", "0"):
        return False
    raise ValueError(f"{answer!r} is not yes or no.")


def parse_text(answer: str) -> str | None:
    """The text, or None for an empty answer or ``none``."""
    return None if answer.strip().lower() in ("", "none") else answer.strip()
