"""How much memory training a model takes per rank, before running it (``lockstep estimate-memory``).

Names are imported on first use, so that the command line can check its options without importing torch.

Example:
    >>> from lockstep.memory.estimate import describe_model, estimate_memory
    >>> model = describe_model("BertConfig", settings={"num_hidden_layers": 2})
    >>> estimate = estimate_memory(model, num_processes=[1, 8], dtypes=["bf16"], strategies=["zero3"])
    >>> [row.model_state for row in estimate.rows] == [16 * model.num_parameters, 2 * model.num_parameters]
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lockstep._lazy import lazy_exports

_EXPORTS = {
    "MemoryEstimate": "lockstep.memory.estimate.estimator",
    "estimate_memory": "lockstep.memory.estimate.estimator",
    "STRATEGIES": "lockstep.memory.estimate.formulas",
    "RankMemory": "lockstep.memory.estimate.formulas",
    "MeshLayout": "lockstep.memory.estimate.formulas",
    "TransformerShape": "lockstep.memory.estimate.formulas",
    "ModelDescription": "lockstep.memory.estimate.model_source",
    "describe_model": "lockstep.memory.estimate.model_source",
}

if TYPE_CHECKING:
    from lockstep.memory.estimate.estimator import MemoryEstimate, estimate_memory
    from lockstep.memory.estimate.formulas import STRATEGIES, MeshLayout, RankMemory, TransformerShape
    from lockstep.memory.estimate.model_source import ModelDescription, describe_model


__getattr__ = lazy_exports(__name__, _EXPORTS)[0]


__all__ = [
    "STRATEGIES",
    "MemoryEstimate",
    "MeshLayout",
    "ModelDescription",
    "RankMemory",
    "TransformerShape",
    "describe_model",
    "estimate_memory",
]
