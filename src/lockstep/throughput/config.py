"""``ThroughputKwargs``: the settings of per-step throughput accounting."""

from __future__ import annotations

from dataclasses import dataclass

from lockstep.config.kwargs import KwargsHandler


@dataclass(kw_only=True)
class ThroughputKwargs(KwargsHandler):
    """Turn on per-step throughput accounting and tune it (``Accelerator(step_timing=True)`` uses the defaults).

    Example:
        >>> handler = ThroughputKwargs(log_every_n_steps=10, peak_flops=400e12)
        >>> # accelerator = Accelerator(kwargs_handlers=[handler]); then accelerator.step_stats
    """

    log_every_n_steps: int = 10
    """Every this many optimizer steps, send the figures of those steps to the active trackers (times per
    step averaged over them, rates over them; 0: never). ``step_stats`` always holds the last step's."""
    count_flops: bool = True
    """Count the model's FLOPs once, on the first step, with ``torch.utils.flop_counter.FlopCounterMode``."""
    peak_flops: float | None = None
    """Peak FLOP/s of one device, for MFU on hardware missing from the built-in table (or on the CPU)."""

    def __post_init__(self) -> None:
        if isinstance(self.log_every_n_steps, bool) or not isinstance(self.log_every_n_steps, int):
            raise TypeError(
                f"ThroughputKwargs(log_every_n_steps={self.log_every_n_steps!r}) is invalid: pass an integer "
                "(0 turns automatic logging off)."
            )
        if self.log_every_n_steps < 0:
            raise ValueError(
                f"ThroughputKwargs(log_every_n_steps={self.log_every_n_steps}) is invalid: it must be >= 0 "
                "(0 turns automatic logging off)."
            )
        if self.peak_flops is not None and not self.peak_flops > 0:
            raise ValueError(
                f"ThroughputKwargs(peak_flops={self.peak_flops!r}) is invalid: give one device's peak in FLOP/s "
                "(for example 989e12 for an H100's bf16 tensor cores), or None to use the built-in table."
            )
