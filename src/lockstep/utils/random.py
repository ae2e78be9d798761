"""``accelerate.utils.random``: seeding every generator and keeping them in step across processes.

The functions are :mod:`lockstep.rng`'s.

Example:
    >>> import torch
    >>> set_seed(7)
    >>> first = torch.rand(1)
    >>> set_seed(7)
    >>> bool(torch.equal(first, torch.rand(1)))
    True
    >>> synchronize_rng_states(["torch"])  # one process: nothing to copy
"""

from lockstep.rng import set_seed, synchronize_rng_state, synchronize_rng_states

__all__ = ["set_seed", "synchronize_rng_state", "synchronize_rng_states"]
