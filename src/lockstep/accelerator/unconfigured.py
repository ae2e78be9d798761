"""Accelerate 1.15's Accelerator members for DeepSpeed sequence parallelism, FP8 and LOMO optimizers.

lockstep builds none of these yet, so each member answers as Accelerate does when the feature is not
configured: the FP8 backend is ``NO`` and the dataloader adapter for sequence parallelism returns the
loader. The members of a ``ParallelismConfig`` (``pipeline_parallel_rank`` and ``maybe_context_parallel``
included) are :mod:`.mesh_view`'s. The base stands on its own: it needs nothing.

Example:
    >>> features = UnconfiguredFeatures()
    >>> features.fp8_backend, features.has_lomo_optimizer
    (<FP8BackendType.NO: 'NO'>, False)
"""

from __future__ import annotations

from typing import Any

import torch

from lockstep.config.kwargs import FP8BackendType


class UnconfiguredFeatures:
    """What Accelerate's sequence parallelism, FP8 and LOMO members answer when none is configured."""

    fp8_enabled: bool = False
    """Whether training runs in FP8 (``mixed_precision="fp8"``); lockstep has no FP8 backend."""
    has_fp8_handler: bool = False
    delayed_fp8_autocast: bool = False
    fp8_recipe_handler: Any = None
    ao_recipe_handler: Any = None
    te_recipe_handler: Any = None
    msamp_recipe_handler: Any = None
    has_lomo_optimizer: bool = False
    """Whether a LOMO optimizer (``lomo-optim``) was prepared; lockstep does not prepare them."""

    # -- parallelism --------------------------------------------------------------------------
    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: Any) -> Any:
        """The loader unchanged: without sequence parallelism (``sp_size`` 1) Accelerate returns it as is."""
        return dl

    # -- FP8 and LOMO ------------------------------------------------------------------------------
    @property
    def fp8_backend(self) -> FP8BackendType:
        """The FP8 training library: ``FP8BackendType.NO`` (lockstep has no FP8 backend)."""
        return FP8BackendType.NO

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        """Raises: LOMO optimizers fuse the update into backward, which lockstep does not support."""
        raise NotImplementedError(
            "Accelerator.lomo_backward() is not supported: LOMO optimizers (the lomo-optim package's Lomo and "
            "AdaLomo) update the weights inside backward, and lockstep does not prepare them. Use a "
            "torch.optim optimizer with accelerator.backward(loss)."
        )
