"""The N-D layout's vocabulary: the ``parallelism_config`` section, its keys and switch, next to ``ParallelismConfig``.

:data:`LAYOUT` (a :class:`~lockstep.config.setting_specs.SettingSpec`) declares it once, and
:data:`PARALLELISM_KEYS` is the only place where a key is spelled (Accelerate's spelling, with the
``parallelism_config_`` prefix). Read from them, as every backend's and layer's vocabulary is
(:func:`lockstep.config.backend_specs.sectioned_specs`):

* the config file's ``parallelism_config`` section (:func:`lockstep.config.file.section_keys`);
* the ``lockstep launch --use-parallelism-config`` switch and ``--parallelism-config-*`` flags (both
  spellings) and the conversion of their text (``lockstep.cli.launch_flags``);
* the ``ParallelismConfig`` the workers build from the launcher's section (:func:`config_from_section`),
  which the launcher also builds once to check the sizes against ``--num-processes`` before starting them
  (:func:`check_section`);
* ``lockstep config``'s device-mesh questions (:func:`ask_layout`) and the file's summary.

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

from collections.abc import Callable, Mapping
from typing import Any

from lockstep.config import checks
from lockstep.config.answers import parse_int
from lockstep.config.keys import SettingKey, by_spelling, lookup
from lockstep.config.parallelism import CP_COMM_STRATEGIES, ParallelismConfig, TorchContextParallelConfig
from lockstep.config.setting_specs import SettingSpec, register_setting_spec

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
    SettingKey(
        key="parallelism_config_ep_size",
        field="ep_size",
        check=checks.int_range(1),
        help="processes a mixture-of-experts model's experts are sharded over (expert parallelism; divides the "
        "data-parallel size)",
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


def check_section(section: dict[str, Any], launch: Mapping[str, Any]) -> None:
    """The launcher's check: build the ``ParallelismConfig`` once, so that sizes that do not multiply to
    ``num_processes`` (or a layout lockstep does not build) fail before any process starts; in an elastic job,
    also on every smaller number of machines the job may continue on (the data-parallel sizes follow it).

    Example:
        >>> check_section({"parallelism_config_tp_size": 2}, {"num_processes": 3, "num_machines": 1})
        Traceback (most recent call last):
        ValueError: ParallelismConfig settings: ParallelismConfig(dp_replicate_size=1, dp_shard_size=1, tp_size=2, cp_size=1, sp_size=1, pp_size=1) needs 1 x 1 x 2 x 1 x 1 x 1 = 2 processes, but this run has 3. Choose sizes whose product is 3, or launch 2 processes.
    """
    processes, machines = launch["num_processes"], launch["num_machines"]
    fewest = launch.get("min_num_machines")
    elastic = fewest is not None and fewest < machines
    try:
        config_from_section(section).validate_world_size(processes, elastic=elastic)
        for count in range(fewest, machines) if elastic else ():
            config_from_section(section).validate_world_size(count * processes // machines, elastic=True)
    except (TypeError, ValueError) as error:
        raise ValueError(f"ParallelismConfig settings: {error}") from None


def summarize(section: Mapping[str, Any]) -> str:
    """A given section in a few words: its sizes other than 1.

    Example:
        >>> summarize({"parallelism_config_tp_size": 2, "parallelism_config_dp_shard_size": 1})
        'device mesh tp=2'
    """
    sizes = [
        f"{key.removeprefix(PREFIX).removesuffix('_size')}={value}"
        for key, value in section.items()
        if key.endswith("_size") and value not in (None, 1)
    ]
    return f"device mesh {' x '.join(sizes) or 'data parallel'}"


def ask_layout(ask: Callable[..., Any], processes: int) -> dict[str, Any]:
    """``lockstep config``'s questions: tensor-parallel size, context-parallel size, then FSDP shard size; the
    rest of the processes are replicas."""
    tp = ask("Tensor-parallel size (processes each layer is split over)?", "1", _divisor_of(processes))
    cp = ask(
        "Context-parallel size (processes each sequence is split over; needs causal SDPA attention)?",
        "1",
        _divisor_of(processes // tp),
    )
    rest = processes // (tp * cp)
    shard = ask(
        f"FSDP shard size (of the {rest} remaining processes; the others replicate, HSDP)?",
        str(rest),
        _divisor_of(rest),
    )
    sizes = {"dp_replicate_size": rest // shard, "dp_shard_size": shard, "tp_size": tp, "cp_size": cp}
    return {entry.key: sizes[entry.field] for entry in PARALLELISM_KEYS if entry.field in sizes}


def _divisor_of(total: int) -> Callable[[str], int]:
    def parse(answer: str) -> int:
        number = parse_int(1)(answer)
        if total % number:
            raise ValueError(f"{number} does not divide {total} processes.")
        return number

    return parse


LAYOUT = register_setting_spec(
    SettingSpec(
        name="mesh",
        summary="the processes laid out on an N-D device mesh (a ParallelismConfig in every worker; unset sizes "
        "are 1)",
        title="ParallelismConfig",
        plugin_type=ParallelismConfig,
        accelerator_argument="parallelism_config",
        config_section=SECTION,
        keys=PARALLELISM_KEYS,
        enable_flag="use_parallelism_config",
        check_section=check_section,
        plugin_from_section=config_from_section,
        questions=ask_layout,
        summarize=summarize,
    )
)
"""The N-D layout's vocabulary; ``TrainingArguments(parallelism_config=...)`` is a field of its own (it takes
a ``ParallelismConfig`` or a dict of its sizes, not this section)."""
