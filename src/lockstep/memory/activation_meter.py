"""The bytes a forward pass keeps alive for backward, counted storage by storage.

:class:`KeptActivations` is a ``TorchDispatchMode``: it sees every operator a forward runs, also inside
checkpointed regions, selective-checkpoint caches and offload hooks (which replace any outer
``saved_tensors_hooks``, so that a meter built on those hooks sees nothing of a checkpointed block). It
remembers a weak reference to the storage of every tensor an operator returns; after the forward, the storages
still alive are what the autograd graph (and the caller, for the output) keeps for backward. A storage counts
once however many tensors view it. Parameters and buffers are left out.

The same count runs on the meta device (no memory, no data), which is how ``lockstep estimate-memory`` predicts
what each activation policy keeps (:func:`trace_kept_activations`).

Example:
    >>> import torch
    >>> layer, batch = torch.nn.Linear(8, 8), torch.ones(4, 8)
    >>> with KeptActivations(exclude=layer.parameters()) as meter:
    ...     out = torch.relu(layer(batch))
    >>> meter.kept_bytes()  # relu's output, saved by relu and returned (the Linear's input was made outside)
    128
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lockstep.memory import activation_policy
from lockstep.memory.activation_policy import ActivationPolicy, apply_activation_policy


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return None


class KeptActivations(TorchDispatchMode):
    """Counts the storages that operators create and that are still alive (see the module docstring)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._excluded = {s._cdata for t in exclude if (s := _storage(t)) is not None}
        self._storages: dict[int, tuple[StorageWeakRef, int, str]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._record(tensor)
        return out

    def _record(self, tensor: torch.Tensor) -> None:
        storage = _storage(tensor)
        if storage is None or storage._cdata in self._excluded:
            return
        known = self._storages.get(storage._cdata)
        if known is None or known[0].expired():  # a freed storage's address can be reused by a new one
            self._storages[storage._cdata] = (StorageWeakRef(storage), storage.nbytes(), tensor.device.type)

    def alive(self) -> dict[int, tuple[int, str]]:
        """The storages alive now: their address, bytes and device type."""
        return {
            key: (nbytes, device)
            for key, (ref, nbytes, device) in self._storages.items()
            if not ref.expired()
        }

    def by_device(self) -> dict[str, int]:
        """Bytes of the storages alive now, by device type (``cpu``, ``cuda``, ``meta``)."""
        totals: dict[str, int] = {}
        for nbytes, device in self.alive().values():
            totals[device] = totals.get(device, 0) + nbytes
        return totals

    def kept_bytes(self) -> int:
        """Bytes of the storages alive now, on every device."""
        return sum(self.by_device().values())


@dataclass(frozen=True)
class KeptEstimate:
    """What one policy keeps for backward after the forward: ``kept`` bytes in all, of which ``offloaded``
    would sit in CPU memory instead of on the accelerator (``offload`` policy)."""

    policy: str
    kept: int
    offloaded: int = 0

    @property
    def on_device(self) -> int:
        return self.kept - self.offloaded


def trace_kept_activations(
    model: nn.Module,
    *,
    blocks: Callable[[nn.Module], Sequence[nn.Module]],
    policies: Sequence[ActivationPolicy],
    forward: Callable[[nn.Module], Any],
) -> list[KeptEstimate]:
    """Run ``forward(model)`` once per policy on a copy of ``model`` (best on the meta device: nothing is
    allocated) with the policy applied to ``blocks(copy)``, and count what each keeps for backward.

    The ``offloaded`` bytes are the storages made in the forward and saved through the ``offload`` policy's
    hooks, which on an accelerator are copied to CPU memory and freed on the device (the host copies can be
    more: ``save_on_cpu`` copies a storage once per tensor saved from it).
    """
    return [_trace_one(model, blocks=blocks, policy=policy, forward=forward) for policy in policies]


def _trace_one(
    model: nn.Module,
    *,
    blocks: Callable[[nn.Module], Sequence[nn.Module]],
    policy: ActivationPolicy,
    forward: Callable[[nn.Module], Any],
) -> KeptEstimate:
    replica = copy.deepcopy(model)
    replica.train()
    apply_activation_policy(replica, blocks(replica), policy)
    packed: dict[int, int] = {}

    def observe(tensor: torch.Tensor) -> None:
        storage = _storage(tensor)
        if storage is not None:
            packed[storage._cdata] = storage.nbytes()

    activation_policy.OFFLOAD_OBSERVERS.append(observe)
    try:
        with KeptActivations(exclude=[*replica.parameters(), *replica.buffers()]) as meter:
            output = forward(replica)
        alive = meter.alive()
    finally:
        activation_policy.OFFLOAD_OBSERVERS.remove(observe)
    del output
    kept = sum(nbytes for nbytes, _ in alive.values())
    # what leaves the device: the saved storages made in the forward (the caller's batch stays where it is)
    offloaded = sum(nbytes for key, nbytes in packed.items() if key in alive)
    return KeptEstimate(policy.name, kept, offloaded=offloaded)
