"""SLURM's compressed host lists, expanded as ``scontrol show hostnames`` does.

A list is host expressions separated by commas (or whitespace). An expression is literal text with any
number of bracket groups; each group holds comma-separated numbers or ranges ``lo-hi``, and a range keeps
the zero padding of its lower bound. Several groups multiply out, the first one varying slowest.

Example:
    >>> expand_hostlist("node[01-03,07],login1")
    ['node01', 'node02', 'node03', 'node07', 'login1']
    >>> expand_hostlist("rack[1-2]n[8-9]")
    ['rack1n8', 'rack1n9', 'rack2n8', 'rack2n9']
"""

from __future__ import annotations

import itertools
import re

MAX_HOSTS = 1_000_000
"""More hosts than any cluster has: a bigger expansion is a typo (``node[1-100000000]``), not a job."""


def expand_hostlist(text: str) -> list[str]:
    """Every host of a compressed SLURM host list, in order (duplicates kept, as scontrol does).

    Raises:
        ValueError: unbalanced brackets, a range whose end is below its start, text that is not a number
            inside brackets, or an expansion of more than ``MAX_HOSTS`` hosts.
    """
    hosts: list[str] = []
    for expression in _split_top_level(text):
        hosts.extend(_expand_expression(expression, text))
        if len(hosts) > MAX_HOSTS:
            raise ValueError(f"host list {text!r} expands to more than {MAX_HOSTS} hosts; check its ranges.")
    if not hosts:
        raise ValueError(f"host list {text!r} names no host.")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """The host expressions: split at commas and whitespace outside brackets."""
    expressions, current, depth = [], [], 0
    for char in text:
        if char == "[":
            if depth:
                raise ValueError(f"host list {text!r} nests brackets, which SLURM never writes.")
            depth = 1
        elif char == "]":
            if not depth:
                raise ValueError(f"host list {text!r} closes a bracket it never opened.")
            depth = 0
        if depth == 0 and (char == "," or char.isspace()):
            expressions.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise ValueError(f"host list {text!r} opens a bracket it never closes.")
    expressions.append("".join(current))
    return [expression for expression in expressions if expression]


def _expand_expression(expression: str, text: str) -> list[str]:
    """``a[1-2]b[3,5]`` -> a1b3 a1b5 a2b3 a2b5."""
    parts = re.split(r"(\[[^\]]*\])", expression)
    choices = [_expand_group(part[1:-1], text) if part.startswith("[") else [part] for part in parts]
    return ["".join(combination) for combination in itertools.product(*choices)]


def _expand_group(body: str, text: str) -> list[str]:
    """The inside of one bracket group: ``01-03,07`` -> 01 02 03 07."""
    values: list[str] = []
    for piece in body.split(","):
        low, dash, high = piece.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(
                f"host list {text!r}: [{body}] must hold numbers or ranges such as 01-04, not {piece!r}."
            )
        if not dash:
            values.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"host list {text!r}: the range {piece} ends below its start.")
        if int(high) - int(low) >= MAX_HOSTS:
            raise ValueError(f"host list {text!r} expands to more than {MAX_HOSTS} hosts; check its ranges.")
        values.extend(str(number).zfill(len(low)) for number in range(int(low), int(high) + 1))
    return values
