"""Documented import path of :mod:`lockstep.memory.accounting` (kept so that existing code keeps working)."""

from lockstep.memory.accounting import MemoryAccount, account_memory, account_parameters, peak_rss_bytes

__all__ = ["MemoryAccount", "account_memory", "account_parameters", "peak_rss_bytes"]
