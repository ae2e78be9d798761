"""``lockstep.utils``: Accelerate's ``accelerate.utils``, under the same names and submodule paths.

``from accelerate.utils import X`` becomes ``from lockstep.utils import X``, and
``from accelerate.utils.operations import X`` becomes ``from lockstep.utils.operations import X`` (likewise
``constants``, ``dataclasses``, ``environment``, ``imports``, ``memory``, ``modeling``, ``offload``,
``other``, ``random``, ``versions``, ``fsdp_utils``, ``tqdm``, ``deepspeed``). The implementations are
lockstep's own, on torch; the DeepSpeed names are those of lockstep's DeepSpeed backend.

Names for hardware and integrations lockstep does not drive (Megatron-LM, TPUs through torch_xla,
bitsandbytes, FP8 through Transformer Engine / MS-AMP / torchao, SageMaker, Accelerate's deprecated
``TorchTensorParallelPlugin``) import fine, and constructing or calling them
raises ``NotImplementedError`` saying so; their submodules (``megatron_lm``, ``torch_xla``, ``bnb``,
``transformer_engine``, ``ao``, ``launch``) exist for the same reason.

The package holds no list of its own: it re-exports every name in its submodules' ``__all__``, except the
few that Accelerate also keeps in their submodule only (:data:`_SUBMODULE_ONLY`).

Example:
    >>> import torch
    >>> from lockstep.utils import convert_to_fp32, find_batch_size, patch_environment
    >>> find_batch_size({"input_ids": torch.zeros(8, 16)})
    8
    >>> convert_to_fp32([torch.ones(1, dtype=torch.float16)])[0].dtype
    torch.float32
"""

from collections.abc import Iterable as _Iterable
from types import ModuleType as _ModuleType
from typing import Any as _Any

_SUBMODULES = (
    "constants",
    "dataclasses",
    "environment",
    "imports",
    "memory",
    "modeling",
    "offload",
    "operations",
    "other",
    "random",
    "versions",
    "fsdp_utils",
    "tqdm",
    "deepspeed",
    "launch",
    "megatron_lm",
    "bnb",
    "transformer_engine",
    "torch_xla",
    "ao",
)
"""The submodules at Accelerate's ``accelerate.utils.<name>`` paths, whose ``__all__`` the package re-exports."""

_SUBMODULE_ONLY = frozenset(
    {
        "CPUInformation",
        "FP8BackendType",
        "STR_OPERATION_TO_FUNC",
        "compute_module_total_buffer_size",
        "get_driver_version",
        "get_non_persistent_buffers",
        "get_shape",
        "torch_version",
    }
)
"""Public in their submodule (as in Accelerate), but not names of Accelerate's ``accelerate.utils``."""


def _exports(modules: _Iterable[_ModuleType]) -> dict[str, _Any]:
    """Each submodule's ``__all__`` names and objects, less :data:`_SUBMODULE_ONLY`."""
    exports: dict[str, _Any] = {}
    for module in modules:
        for name in module.__all__:
            value = getattr(module, name)
            # Two submodules may list one name only when it is one object (one implementation).
            assert exports.get(name, value) is value, f"lockstep.utils.{name} differs between submodules"
            if name not in _SUBMODULE_ONLY:
                exports[name] = value
    return exports


# __import__ rather than importlib.import_module: `python -X importtime` then times each submodule apart.
_EXPORTED = _exports(__import__(f"{__name__}.{name}", fromlist=["__all__"]) for name in _SUBMODULES)
# After the submodule imports, so that the function ``tqdm`` replaces the submodule ``tqdm`` as the
# package's name, as in Accelerate.
globals().update(_EXPORTED)
__all__ = sorted(_EXPORTED)
