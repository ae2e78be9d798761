"""The N-D parallelism vocabulary: every ``parallelism_config`` key, in one table next to ``ParallelismConfig``.

:data:`PARALLELISM_KEYS` is the only place where such a key is spelled (Accelerate's spelling, with the
``parallelism_config_`` prefix). Derived from it:

* the config file's ``parallelism_config`` check (``lockstep.config.file.PARALLELISM_CONFIG_KEYS``);
* the ``lockstep launch --parallelism-config-*`` flags (both spellings) and the conversion of their text
  (``lockstep.cli.launch_flags``);
* the ``ParallelismConfig`` the workers build from the launcher's section (:func:`config_from_section`),
  which the launcher also builds once to check the sizes against ``--num-processes`` before starting them.

Accelerate's sequence-parallel keys (``parallelism_config_sp_*``, DeepSpeed-Ulysses) are not in the table:
lockstep does not build sequence parallelism, and their flags are refused.

This module must not import torch.

Example:
    >>> config_from_section({"parallelism_config_dp_shard_size": 2, "parallelism_config_tp_size": 2})
    ParallelismConfig(dp_replicate_size=1, dp_shard_size=2, tp_size=2, cp_size=1, sp_size=1, pp_size=1, total_size=4, tp_handler=TorchTensorParallelConfig(enable_async_tp=False, parallelize_plan=None), cp_handler=None, pp_handler=None)
    >>> config_from_section({"parallelism_config_pp_size": 2})
    Traceback (most recent call last):
    ValueError: parallelism_config.parallelism_config_pp_size is not a setting of ParallelismConfig.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lockstep.config import checks
from lockstep.config.keys import SettingKey, by_spelling, lookup
from lockstep.config.parallelism import CP_COMM_STRATEGIES, ParallelismConfig, TorchContextParallelConfig

PREFIX = "parallelism_config_"
"""The prefix of every key, as Accelerate writes them in ``parallelism_config:``."""
SECTION = "parallelism_config"

PARALLELISM_KEYS: tuple[SettingKey, ...] = (
    SettingKey(
        key="parallelism_config_dp_replicate_size",
        field="dp_replicate_size",
        check=checks.int_range(1),
        help="replicas of the (sharded) model; with dp_shard_size > 1 this is HSDP",
        flag=True,
    ),
    SettingKey(
        key="parallelism_config_dp_shard_size",
        field="dp_shard_size",
        check=checks.int_range(1),
        help="processes one model replica is sharded over with FSDP2",
        flag=True,
    ),
    SettingKey(
        key="parallelism_config_tp_size",
        field="tp_size",
        check=checks.int_range(1),
        help="processes each layer is split over (tensor parallelism)",
        flag=True,
    ),
    SettingKey(
        key="parallelism_config_cp_size",
        field="cp_size",
        check=checks.int_range(1),
        help="processes a sequence is split over (context parallelism: accelerator.maybe_context_parallel)",
        flag=True,
    ),
    SettingKey(
        key="parallelism_config_cp_backend",
        field="cp_backend",
        check=checks.choice("torch"),
        help="context-parallel backend: torch",
        flag=True,
    ),
    SettingKey(
        key="parallelism_config_cp_comm_strategy",
        field="cp_comm_strategy",
        check=checks.choice(*CP_COMM_STRATEGIES),
        help="how context parallelism exchanges keys and values: allgather or alltoall",
        flag=True,
    ),
)
"""Every ``parallelism_config`` key: the config file's, and the launch flags'."""

_SPELLINGS = by_spelling(PARALLELISM_KEYS, PREFIX)


def config_from_section(section: Mapping[str, Any]) -> ParallelismConfig:
    """The ``ParallelismConfig`` a ``parallelism_config`` section describes (unset sizes: the
    ``PARALLELISM_CONFIG_*`` variables, else 1, as ``ParallelismConfig()`` does).

    Raises:
        ValueError: a key of no setting, or a value its check (or ``ParallelismConfig``) rejects.
    """
    kwargs: dict[str, Any] = {}
    for key, value in section.items():
        entry = lookup(_SPELLINGS, key, PREFIX)
        if entry is None:
            raise ValueError(f"{SECTION}.{key} is not a setting of ParallelismConfig.")
        if value is not None:
            kwargs[entry.field] = entry.check(value, f"{SECTION}.{key}")
    strategy = kwargs.pop("cp_comm_strategy", None)
    config = ParallelismConfig(**kwargs)
    if strategy is not None and config.cp_handler is not None:
        config.cp_handler = TorchContextParallelConfig(cp_comm_strategy=strategy)
    return config
