"""``accelerate.utils.versions``: comparing installed package versions.

Example:
    >>> is_torch_version(">=", "2.0")
    True
    >>> compare_versions("numpy", "<", "0.1")
    False
"""

from __future__ import annotations

import importlib.metadata

from packaging.version import Version, parse

from lockstep.utils.constants import STR_OPERATION_TO_FUNC

__all__ = ["compare_versions", "is_torch_version", "torch_version"]

torch_version = parse(importlib.metadata.version("torch"))
"""The installed torch's version (``packaging.version.Version``, local part such as ``+cpu`` included)."""


def compare_versions(library_or_version: str | Version, operation: str, requirement_version: str) -> bool:
    """Compare an installed library's version (or a given version) with ``requirement_version``.

    Args:
        library_or_version: a distribution name such as ``"torch"`` (its installed version is read), or a
            ``packaging.version.Version``.
        operation: one of ``">"``, ``">="``, ``"=="``, ``"!="``, ``"<="``, ``"<"``.
        requirement_version: the version to compare with, e.g. ``"2.4.0"``.

    Raises:
        ValueError: ``operation`` is not one of the six comparisons.
        importlib.metadata.PackageNotFoundError: the library is not installed.

    Example:
        >>> from packaging.version import Version
        >>> compare_versions(Version("2.4.1"), ">=", "2.4")
        True
    """
    if operation not in STR_OPERATION_TO_FUNC:
        raise ValueError(
            f"compare_versions(operation={operation!r}) is invalid: use one of "
            f"{', '.join(map(repr, STR_OPERATION_TO_FUNC))}."
        )
    if isinstance(library_or_version, str):
        library_or_version = parse(importlib.metadata.version(library_or_version))
    return STR_OPERATION_TO_FUNC[operation](library_or_version, parse(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    """Compare the installed torch's version with ``version``, e.g. ``is_torch_version(">=", "2.4")``.

    Example:
        >>> is_torch_version("<", "1.0")
        False
    """
    return compare_versions(torch_version, operation, version)
