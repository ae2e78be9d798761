"""``ParallelismConfig``: how the processes are laid out on an N-D device mesh (Accelerate's names).

The processes form a mesh with up to six dimensions, in torchtitan's order ``pp, dp_replicate, dp_shard,
cp, sp, tp`` (Accelerate's order with lockstep's pipeline dimension ``pp`` outermost; only the dimensions
of size > 1 exist). Three flattened sub-meshes are added: ``dp`` (the
data-parallel dimensions), ``dp_shard_cp`` (what FSDP shards over: ``dp_shard`` with ``cp``/``sp``) and
``dp_cp`` (what the loss is averaged over). Ranks that differ only in ``tp`` (or ``cp``) see the same batch.

- ``dp_shard_size > 1``: FSDP2 over ``dp_shard``; with ``dp_replicate_size > 1`` too, HSDP.
- ``tp_size > 1``: tensor parallelism (``parallelize_module``) over ``tp``, then FSDP over ``dp_shard``.
- ``pp_size > 1``: pipeline parallelism over ``pp`` (lockstep's extension; ``pp_handler`` says how), then
  FSDP over ``dp_shard`` within each stage.
- every size 1 on N processes: plain data parallelism (``dp_replicate = N``), as in Accelerate.

Unlike Accelerate, lockstep builds these meshes on CPUs (gloo) as on GPUs, so a layout can be tested
before renting GPUs. Sizes default to the ``PARALLELISM_CONFIG_*`` environment variables, else 1.

Example:
    >>> config = ParallelismConfig(dp_shard_size=2, tp_size=2)
    >>> config.total_size, config.data_parallel_size, config.active_mesh_dims, config.fsdp_dim_names
    (4, 2, ['dp_shard', 'tp'], ['dp_shard_cp'])
    >>> ParallelismConfig(tp_size=0)
    Traceback (most recent call last):
    ValueError: ParallelismConfig(tp_size=0) is invalid: every size must be an integer >= 1 (1 switches the dimension off).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lockstep import _env
from lockstep.config.pipeline import TorchPipelineParallelConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "sp", "tp")
"""The order of the mesh dimensions (outermost first): Accelerate's, with the pipeline dimension first."""
_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size", "pp_size")
PLAN_STYLES = ("colwise", "rowwise", "sequence_parallel")
"""The names a ``parallelize_plan`` may use instead of a torch ``ParallelStyle`` object."""
CP_COMM_STRATEGIES = ("allgather", "alltoall")


@dataclass
class TorchTensorParallelConfig:
    """How tensor parallelism (``tp_size > 1``) shards the model (Accelerate's class, plus the plan).

    Example:
        >>> TorchTensorParallelConfig(parallelize_plan={"layers.*.up": "colwise", "layers.*.down": "rowwise"})
        TorchTensorParallelConfig(enable_async_tp=False, parallelize_plan={'layers.*.up': 'colwise', 'layers.*.down': 'rowwise'})
    """

    enable_async_tp: bool = False
    """torch's asynchronous TP (symmetric-memory micro-pipelining, CUDA only); not built in lockstep."""
    parallelize_plan: Mapping[str, Any] | None = None
    """lockstep's addition: module-name patterns (``*`` matches one name part, as in torch's
    ``parallelize_module``) to ``"colwise"``, ``"rowwise"``, ``"sequence_parallel"`` or a torch
    ``ParallelStyle``. None: the model's own plan (transformers' ``base_model_tp_plan``), or a model loaded
    already sharded (``from_pretrained(tp_plan="auto", device_mesh=...)``)."""

    def __post_init__(self) -> None:
        if self.enable_async_tp:
            raise NotImplementedError(
                "TorchTensorParallelConfig(enable_async_tp=True) is not built yet in lockstep: asynchronous tensor "
                "parallelism needs torch's symmetric memory (CUDA only). Leave enable_async_tp=False."
            )
        if self.parallelize_plan is None:
            return
        if not isinstance(self.parallelize_plan, Mapping):
            raise TypeError(
                f"TorchTensorParallelConfig(parallelize_plan=...) must map module-name patterns to styles, got "
                f"{type(self.parallelize_plan).__name__}."
            )
        from torch.distributed.tensor.parallel import ParallelStyle

        for pattern, style in self.parallelize_plan.items():
            if not (style in PLAN_STYLES or isinstance(style, ParallelStyle)):
                raise ValueError(
                    f"TorchTensorParallelConfig(parallelize_plan={{{pattern!r}: {style!r}}}) is invalid: a style is "
                    f"one of {', '.join(map(repr, PLAN_STYLES))} or a torch.distributed.tensor.parallel.ParallelStyle."
                )


@dataclass
class TorchContextParallelConfig:
    """How context parallelism (``cp_size > 1``) exchanges keys and values (Accelerate's class).

    Example:
        >>> TorchContextParallelConfig(cp_comm_strategy="alltoall").cp_comm_strategy
        'alltoall'
    """

    cp_comm_strategy: str | None = None
    """``"allgather"`` (default, or ``PARALLELISM_CONFIG_CP_COMM_STRATEGY``) or ``"alltoall"``."""

    def __post_init__(self) -> None:
        if self.cp_comm_strategy is None:
            self.cp_comm_strategy = _env.parallelism_setting("cp_comm_strategy", "allgather")
        if self.cp_comm_strategy not in CP_COMM_STRATEGIES:
            raise ValueError(
                f"TorchContextParallelConfig(cp_comm_strategy={self.cp_comm_strategy!r}) is invalid: it must be one "
                f"of {', '.join(map(repr, CP_COMM_STRATEGIES))}."
            )


def _size_from_environment(name: str) -> int:
    raw = _env.parallelism_setting(name, "1")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"{_env.PARALLELISM_CONFIG_PREFIX}{name.upper()}={raw!r} is invalid: it must be an integer >= 1."
        ) from None


@dataclass
class ParallelismConfig:
    """The N-D layout of the processes: replicated and sharded data parallelism, tensor and context parallelism.

    Args:
        dp_replicate_size: replicas of the (sharded) model; with ``dp_shard_size > 1`` this is HSDP.
        dp_shard_size: processes one model is sharded over with FSDP2.
        tp_size: processes each layer is split over (tensor parallelism).
        cp_size: processes a sequence is split over (context parallelism).
        cp_backend: ``"torch"``, the only context-parallel backend.
        sp_size: DeepSpeed-Ulysses sequence parallelism; not built in lockstep (must stay 1).
        sp_backend: ``"deepspeed"``, Accelerate's default.
        tp_handler: a :class:`TorchTensorParallelConfig` (made when ``tp_size > 1`` and none is given).
        cp_handler: a :class:`TorchContextParallelConfig` (made when ``cp_size > 1`` and none is given).
        sp_handler: accepted for Accelerate's signature; sequence parallelism is not built.
        pp_size: pipeline stages the model is cut into across processes (lockstep's extension: Accelerate
            has no pipeline training).
        pp_handler: a :class:`~lockstep.config.pipeline.TorchPipelineParallelConfig` (made when
            ``pp_size > 1`` and none is given): schedule, micro-batches, split points.
        ep_size: processes a mixture-of-experts model's experts are sharded over (expert parallelism,
            lockstep's extension: :mod:`lockstep.layers.expert_parallel`). Borrowed from data parallelism, not a
            dimension of its own: it must divide the data-parallel size, and it does not change ``total_size``.

    Example:
        >>> from lockstep import Accelerator
        >>> accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))  # doctest: +SKIP
        >>> accelerator.torch_device_mesh.mesh_dim_names  # doctest: +SKIP
        ('dp_shard', 'tp')
    """

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    cp_backend: str | None = None
    sp_size: int | None = None
    sp_backend: str | None = None
    tp_handler: TorchTensorParallelConfig | None = None
    cp_handler: TorchContextParallelConfig | None = None
    sp_handler: Any = None
    pp_size: int | None = None
    pp_handler: TorchPipelineParallelConfig | None = None
    ep_size: int | None = None
    device_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    """The mesh, once :meth:`get_device_mesh` built it (the Accelerator builds it)."""
    _flattened_meshes: dict[str, DeviceMesh] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        for name in _SIZES:
            if getattr(self, name) is None:
                setattr(self, name, _size_from_environment(name))
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"ParallelismConfig({name}={value!r}) is invalid: every size must be an integer >= 1 "
                    "(1 switches the dimension off)."
                )
        self._check_expert_parallel()
        if self.cp_backend is None:
            self.cp_backend = _env.parallelism_setting("cp_backend", "torch")
        if self.sp_backend is None:
            self.sp_backend = _env.parallelism_setting("sp_backend", "deepspeed")
        if self.cp_backend != "torch":
            raise ValueError(
                f"ParallelismConfig(cp_backend={self.cp_backend!r}) is invalid: it must be 'torch'."
            )
        self._check_handlers()
        self._check_combinations()

    def _check_expert_parallel(self) -> None:
        if self.ep_size is None:
            self.ep_size = _size_from_environment("ep_size")
        if isinstance(self.ep_size, bool) or not isinstance(self.ep_size, int) or self.ep_size < 1:
            raise ValueError(
                f"ParallelismConfig(ep_size={self.ep_size!r}) is invalid: it must be an integer >= 1 (1 switches "
                "expert parallelism off)."
            )
        hsdp = self.dp_shard_size > 1 and self.dp_replicate_size > 1
        others = {
            name: getattr(self, name)
            for name in _SIZES
            if (name != "dp_replicate_size" or hsdp) and getattr(self, name) > 1
        }
        if self.ep_size > 1 and set(others) - {"dp_shard_size"}:  # FSDP2 alone composes (the ep layer)
            sizes = ", ".join(f"{name}={size}" for name, size in others.items())
            raise NotImplementedError(
                f"ParallelismConfig(ep_size={self.ep_size}, {sizes}) is not built yet: expert parallelism composes "
                "with plain data parallelism (DDP) and with FSDP2 (dp_shard_size) only for now; with HSDP, tensor, "
                "context and pipeline parallelism it comes next (see lockstep.layers.expert_parallel). Set those "
                "sizes to 1."
            )

    def _check_handlers(self) -> None:
        if self.tp_size > 1 and self.tp_handler is None:
            self.tp_handler = TorchTensorParallelConfig()
        if self.cp_size > 1 and self.cp_handler is None:
            self.cp_handler = TorchContextParallelConfig()
        if self.tp_handler is not None and not isinstance(self.tp_handler, TorchTensorParallelConfig):
            raise TypeError(
                f"ParallelismConfig(tp_handler=...) must be a TorchTensorParallelConfig, got "
                f"{type(self.tp_handler).__name__}."
            )
        if self.pp_size > 1 and self.pp_handler is None:
            self.pp_handler = TorchPipelineParallelConfig()
        if self.pp_handler is not None and not isinstance(self.pp_handler, TorchPipelineParallelConfig):
            raise TypeError(
                f"ParallelismConfig(pp_handler=...) must be a TorchPipelineParallelConfig, got "
                f"{type(self.pp_handler).__name__}."
            )
        if self.cp_handler is not None and not isinstance(self.cp_handler, TorchContextParallelConfig):
            raise TypeError(
                f"ParallelismConfig(cp_handler=...) must be a TorchContextParallelConfig, got "
                f"{type(self.cp_handler).__name__}."
            )

    def _check_combinations(self) -> None:
        if self.cp_size > 1 and self.sp_size > 1:
            raise ValueError(
                f"ParallelismConfig(cp_size={self.cp_size}, sp_size={self.sp_size}) is invalid: context and "
                "sequence parallelism both split the sequence; set one of them to 1."
            )
        if (self.tp_size > 1 or self.cp_size > 1) and self.dp_replicate_size > 1 and self.dp_shard_size == 1:
            raise ValueError(
                f"ParallelismConfig(dp_replicate_size={self.dp_replicate_size}, dp_shard_size=1, "
                f"tp_size={self.tp_size}, cp_size={self.cp_size}) is invalid: tensor/context parallelism does not "
                "compose with replicated data parallelism alone (as in Accelerate). Use dp_shard_size instead of "
                "dp_replicate_size (FSDP + TP/CP), or both > 1 (HSDP + TP/CP)."
            )
        if self.pp_size > 1:
            self._check_pipeline_combinations()

    def _check_pipeline_combinations(self) -> None:
        others = {
            name: getattr(self, f"{name}_size")
            for name in ("tp", "cp", "sp")
            if getattr(self, f"{name}_size") > 1
        }
        if others:
            sizes = ", ".join(f"{name}_size={size}" for name, size in others.items())
            raise NotImplementedError(
                f"ParallelismConfig(pp_size={self.pp_size}, {sizes}) is not built yet: pipeline parallelism composes "
                "with data parallelism (dp_shard_size) only. Set the other sizes to 1."
            )
        if self.dp_replicate_size > 1 and self.dp_shard_size == 1:
            raise NotImplementedError(
                f"ParallelismConfig(pp_size={self.pp_size}, dp_replicate_size={self.dp_replicate_size}) is not built "
                "yet: pipeline stages are replicated with FSDP. Use dp_shard_size instead of dp_replicate_size."
            )

    def __repr__(self) -> str:
        sizes = ", ".join(f"{name}={getattr(self, name)}" for name in _SIZES)
        if self.ep_size != 1:  # lockstep's extension, shown when it is on (Accelerate's repr otherwise)
            sizes += f", ep_size={self.ep_size}"
        return (
            f"ParallelismConfig({sizes}, total_size={self.total_size}, tp_handler={self.tp_handler}, "
            f"cp_handler={self.cp_handler}, pp_handler={self.pp_handler})"
        )

    # -- sizes -------------------------------------------------------------------------------------
    @property
    def total_size(self) -> int:
        """The product of all sizes: the number of processes this layout needs."""
        return (
            self.pp_size
            * self.dp_replicate_size
            * self.dp_shard_size
            * self.tp_size
            * self.cp_size
            * self.sp_size
        )

    @property
    def data_parallel_size(self) -> int:
        """Processes that see different batches: ``dp_replicate_size * dp_shard_size``."""
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def non_data_parallel_size(self) -> int:
        """Processes that share a batch: ``tp_size * cp_size * sp_size``."""
        return self.tp_size * self.cp_size * self.sp_size

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate_size > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard_size > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp_size > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp_size > 1

    @property
    def sp_enabled(self) -> bool:
        return self.sp_size > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp_size > 1

    # -- dimension names ---------------------------------------------------------------------------
    def _enabled(self, *names: str) -> list[str]:
        return [name for name in names if getattr(self, f"{name}_size") > 1]

    @property
    def dp_dim_names(self) -> list[str]:
        """The enabled data-parallel dimensions (flattened into ``dp``)."""
        return self._enabled("dp_replicate", "dp_shard")

    @property
    def non_dp_dim_names(self) -> list[str]:
        """The enabled dimensions whose ranks receive the same batch."""
        return self._enabled("tp", "cp", "sp")

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """The enabled dimensions FSDP shards over (flattened into ``dp_shard_cp``)."""
        return self._enabled("dp_shard", "cp", "sp")

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """The enabled dimensions the loss is averaged over (flattened into ``dp_cp``)."""
        return self._enabled("dp_replicate", "dp_shard", "cp", "sp")

    @property
    def fsdp_dim_names(self) -> list[str]:
        """The mesh FSDP is applied on: ``["dp_replicate", "dp_shard_cp"]`` (HSDP) or ``["dp_shard_cp"]``."""
        return [*self._enabled("dp_replicate"), "dp_shard_cp"]

    @property
    def active_mesh_dims(self) -> list[str]:
        """Every enabled dimension."""
        return self._enabled("pp") + self.dp_dim_names + self.non_dp_dim_names

    # -- the mesh ----------------------------------------------------------------------------------
    def _get_mesh(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(dimension names, sizes) of the enabled dimensions in :data:`MESH_ORDER`."""
        names = tuple(name for name in MESH_ORDER if name in self.active_mesh_dims)
        return names, tuple(getattr(self, f"{name}_size") for name in names)

    def build_device_mesh(self, device_type: str) -> DeviceMesh | None:
        """Build the mesh (and the flattened ``dp``, ``dp_shard_cp``, ``dp_cp`` sub-meshes) on the default
        process group; None when every size is 1. A collective: every process calls it."""
        from torch.distributed.device_mesh import init_device_mesh

        names, shape = self._get_mesh()
        if not names:
            return None
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        self._flattened_meshes = {}
        for flat, dims in (
            ("dp", self.dp_dim_names),
            ("dp_shard_cp", self.dp_shard_cp_dim_names),
            ("dp_cp", self.dp_cp_dim_names),
        ):
            if dims:
                self._flattened_meshes[flat] = mesh[tuple(dims)]._flatten(flat)
        return mesh

    def get_device_mesh(self, device_type: str | None = None) -> DeviceMesh | None:
        """The mesh, built on first call for ``device_type``."""
        if self.device_mesh is None:
            if device_type is None:
                raise ValueError(
                    "ParallelismConfig.get_device_mesh() builds the mesh: pass device_type, e.g. 'cuda'."
                )
            self.device_mesh = self.build_device_mesh(device_type)
        elif device_type is not None and self.device_mesh.device_type != device_type:
            raise ValueError(
                f"The device mesh was built for {self.device_mesh.device_type!r}, not {device_type!r}; one "
                "ParallelismConfig serves one device type."
            )
        return self.device_mesh

    def get_submesh(self, dim_names: str | tuple[str, ...] | list[str]) -> DeviceMesh:
        """The sub-mesh of ``dim_names``; a flattened name (``dp``, ``dp_shard_cp``, ``dp_cp``) alone comes
        from the handle kept when it was built (slicing it off the root mesh is deprecated in torch)."""
        if self.device_mesh is None:
            raise RuntimeError("ParallelismConfig.get_submesh(): the device mesh is not built yet.")
        names = (dim_names,) if isinstance(dim_names, str) else tuple(dim_names)
        if len(names) == 1 and names[0] in self._flattened_meshes:
            return self._flattened_meshes[names[0]]
        with warnings.catch_warnings():
            # A flattened name among several (HSDP over dp_shard_cp): torch has no other spelling yet.
            warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
            return self.device_mesh[names]

    # -- checks against the run --------------------------------------------------------------------
    def _set_size(self, parallelism: str, size: int) -> None:
        setattr(self, f"{parallelism}_size", size)

    def validate_world_size(self, num_processes: int, *, elastic: bool = False) -> None:
        """Check the layout against the run: all sizes 1 on N processes becomes ``dp_replicate_size=N``
        (plain data parallelism, as in Accelerate); otherwise the sizes must multiply to N. In an elastic
        job (``elastic``: ``lockstep launch --num-machines MIN:MAX``) the data-parallel sizes follow N
        instead (:meth:`fit_data_parallel`)."""
        if self.total_size == 1 and num_processes > 1:
            self._set_size("dp_replicate", num_processes)
        if elastic and self.total_size != num_processes:
            self.fit_data_parallel(num_processes)
        if self.total_size == num_processes and self.data_parallel_size % self.ep_size:
            raise ValueError(
                f"ParallelismConfig(ep_size={self.ep_size}) does not fit {self.data_parallel_size} data-parallel "
                f"processes: the experts are sharded over groups of ep_size data-parallel ranks, so ep_size must "
                f"divide {self.data_parallel_size}. Choose an ep_size that divides it, or launch a multiple of "
                f"{self.ep_size} processes."
            )
        if self.total_size != num_processes:
            sizes = ", ".join(f"{name}={getattr(self, name)}" for name in _SIZES)
            raise ValueError(
                f"ParallelismConfig({sizes}) needs {' x '.join(str(getattr(self, n)) for n in _SIZES)} = "
                f"{self.total_size} processes, but this run has {num_processes}. Choose sizes whose product is "
                f"{num_processes}, or launch {self.total_size} processes."
            )
        for name in ("tp", "cp", "sp", "pp"):
            if getattr(self, f"{name}_size") == 1 and getattr(self, f"{name}_handler") is not None:
                warnings.warn(
                    f"ParallelismConfig.{name}_handler is set but {name}_size is 1: the handler is ignored.",
                    UserWarning,
                    stacklevel=3,
                )

    def fit_data_parallel(self, num_processes: int) -> str:
        """Resize the data-parallel dimensions so that the sizes multiply to ``num_processes``, keeping the
        model-parallel ones (tp, cp, sp, pp): what an elastic restart on another number of processes needs.
        HSDP keeps ``dp_shard_size`` and changes the replicas. Returns the change, in words (empty when
        nothing changed); raises ``ValueError`` naming the sizes when the model-parallel sizes do not divide
        ``num_processes``.

        Example:
            >>> config = ParallelismConfig(dp_shard_size=2, tp_size=2)
            >>> config.fit_data_parallel(2), config.dp_shard_size
            ('dp_shard_size 2 -> 1 (tp_size=2 kept)', 1)
        """
        kept = {name: getattr(self, name) for name in ("tp_size", "cp_size", "sp_size", "pp_size")}
        fixed = kept["tp_size"] * kept["cp_size"] * kept["sp_size"] * kept["pp_size"]
        described = " x ".join(f"{name}={size}" for name, size in kept.items() if size > 1) or "1"
        if num_processes % fixed:
            raise ValueError(
                f"An elastic job on {num_processes} processes cannot keep this layout: the model-parallel "
                f"sizes ({described} = {fixed} processes per model replica) do not divide {num_processes}. "
                f"Give the job numbers of processes that {fixed} divides (machines x processes per machine, "
                f"for every number of machines it may run on), or choose model-parallel sizes that divide them."
            )
        data = num_processes // fixed
        shard, replicate = self.dp_shard_size, self.dp_replicate_size
        if shard > 1 and replicate > 1:
            if data % shard:
                raise ValueError(
                    f"An elastic job on {num_processes} processes cannot keep this layout: {data} data-parallel "
                    f"ranks, which HSDP's dp_shard_size={shard} does not divide (the replicas change, the shard "
                    f"size is kept). Choose a dp_shard_size that divides every number of data-parallel ranks "
                    f"the job may run on, or give the job numbers of processes that keep {shard} a divisor."
                )
            name, old, new = "dp_replicate_size", replicate, data // shard
        elif shard > 1:
            name, old, new = "dp_shard_size", shard, data
        else:
            name, old, new = "dp_replicate_size", replicate, data
        self._set_size(name.removesuffix("_size"), new)
        kept_words = f" ({described} kept)" if fixed > 1 else ""
        return "" if old == new else f"{name} {old} -> {new}{kept_words}"

    def to_json(self) -> dict[str, Any]:
        """The sizes, backends and handler fields as plain data (without the mesh)."""
        data: dict[str, Any] = {
            name: getattr(self, name) for name in (*_SIZES, "ep_size", "cp_backend", "sp_backend")
        }
        for name in ("tp_handler", "cp_handler"):
            handler = getattr(self, name)
            data[name] = (
                None
                if handler is None
                else {k: v for k, v in vars(handler).items() if k != "parallelize_plan"}
            )
        data["pp_handler"] = None if self.pp_handler is None else self.pp_handler.to_json()
        return data
