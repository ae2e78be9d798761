"""Expert parallelism's vocabulary: a layer that ``ParallelismConfig(ep_size=N)`` turns on.

Its setting is the layout's (``ep_size``, the ``parallelism_config_ep_size`` file key and
``--parallelism-config-ep-size`` launch flag, declared with the other sizes in
:mod:`lockstep.config.parallelism_keys`): it has no keyword, section or switch of its own. Its step hooks are
:mod:`lockstep.layers.expert_parallel._layer`'s. This module must not import torch.
"""

from __future__ import annotations

from typing import Any

from lockstep.config.layer_specs import LayerSpec, register_layer

NAME = "expert_parallel"


def _from_layout(layout: Any) -> Any:
    """The layout itself when it asks for expert parallelism (``ep_size > 1``), else None."""
    return layout if layout.ep_size > 1 else None


SPEC = register_layer(
    LayerSpec(
        name=NAME,
        summary="mixture-of-experts experts sharded over the data-parallel ranks, tokens routed by all-to-all "
        "(ParallelismConfig(ep_size=N))",
        title="expert parallelism",
        step_hooks="lockstep.layers.expert_parallel._layer:expert_parallel_hooks",
        from_layout=_from_layout,
    )
)
