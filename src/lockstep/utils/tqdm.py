"""``accelerate.utils.tqdm``: a tqdm progress bar shown on the main process only.

Example:
    >>> for _ in tqdm(range(3), disable=True):
    ...     pass
"""

from __future__ import annotations

import importlib.util
from typing import Any

from lockstep.state import PartialState

__all__ = ["tqdm"]


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm(*args, **kwargs)``, disabled on every process but each machine's first one.

    Args:
        *args: tqdm's positional arguments (usually the iterable).
        main_process_only: show the bar on the local main process only; False shows it everywhere.
        **kwargs: tqdm's keyword arguments; ``disable=True`` turns the bar off everywhere.

    Raises:
        ImportError: tqdm is not installed.
    """
    if importlib.util.find_spec("tqdm") is None:
        raise ImportError("lockstep.utils.tqdm needs the tqdm package: pip install tqdm")
    from tqdm.auto import tqdm as auto_tqdm

    if main_process_only and not kwargs.get("disable", False):
        kwargs["disable"] = PartialState().local_process_index != 0
    return auto_tqdm(*args, **kwargs)
