"""Layers that act around every training step, run by the Accelerator as one list.

A *step hook* is one small object with the moments of a step it cares about; it never wraps a backend, an
optimizer or a loader, and nothing writes attributes onto those objects: the Accelerator owns one
:class:`StepHooks` list and gives it to every optimizer and loader it prepares, which run it. The step, as the
prepared objects see it::

    model = accelerator.prepare(model)         # hooks.preparing_model(model) before the backend wraps it,
                                               #   hooks.prepared_model(prepared) after
    for batch in loader:                       # hooks.batches(...) wraps each iteration's batches
        loss = model(batch)
        accelerator.backward(loss)             # inside hooks.around_backward()
        accelerator.clip_grad_norm_(...)       # hooks.before_clip(), then hooks.clip_grad_norm_(...) or
                                               #   the backend's clip
        optimizer.step()                       # a synchronising step runs inside
                                               #   hooks.around_optimizer_step(optimizer), where
                                               #   hooks.commit(optimizer) decides whether it is applied

Built-in layers on this interface: the step timer (:mod:`lockstep.throughput`), the hang watchdog's progress
note (:mod:`lockstep.diagnostics`), and the commit answer of fault tolerance
(:mod:`lockstep.layers.fault_tolerance`), and expert parallelism (:mod:`lockstep.layers.expert_parallel`: it
shards a model's experts before the backend wraps it and clips by the norm over every rank's experts);
built-in layers live in :mod:`lockstep.layers`.
Add your own with ``accelerator.add_step_hook(hook)``, or make it a *layer* users switch on like a built-in
feature: a :class:`LayerSpec` (registered with :func:`register_layer`, or by an installed package in the
``lockstep.layers`` entry-point group) names its ``Accelerator`` keyword, ``TrainingArguments`` field, config
section and launch flags, and builds its hooks (see :mod:`lockstep.config.layer_specs`).

Example:
    >>> class CountSteps(StepHook):
    ...     def __init__(self) -> None:
    ...         self.steps = 0
    ...     def around_optimizer_step(self, optimizer: object) -> contextlib.AbstractContextManager[None]:
    ...         self.steps += 1
    ...         return contextlib.nullcontext()
    >>> hooks = StepHooks([CountSteps()])
    >>> with hooks.around_optimizer_step(object()):
    ...     pass
    >>> next(iter(hooks)).steps
    1
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any, TypeVar, final

from lockstep.config.layer_specs import LayerSpec, register_layer, unregister_layer

_NOTHING = contextlib.nullcontext()
C = TypeVar("C")


class StepHook(abc.ABC):  # noqa: B024 (every moment has a default: a hook overrides the ones it needs)
    """One layer acting around every training step. Override the moments you need; the others do nothing
    and cost nothing (:class:`StepHooks` calls only the hooks that override a moment).

    The moments run on every step, so keep them cheap: take a clock mark, count, note progress.
    """

    def preparing_model(self, model: Any) -> Any:
        """A model ``prepare`` is about to hand to the backend for training (not one prepared for evaluation
        only): return it, changed in place or replaced. A layer that changes what the backend distributes does
        it here (expert parallelism shards the experts and has DDP leave them out of its all-reduce)."""
        return model

    def prepared_model(self, model: object) -> None:
        """A model ``prepare`` has just prepared for training (as the backend returned it; not one prepared
        for evaluation only): a layer notes it (fault tolerance sends it to a healing peer)."""
        return None

    def prepared_optimizer(self, optimizer: object) -> None:
        """An optimizer ``prepare`` has just prepared (the backend's, inside the Accelerator's wrapper)."""
        return None

    def batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        """The batches one iteration of a prepared loader hands over to the loop (before their forward):
        return ``batches`` or an iterator that yields the same batches (the step timer times each ``next``)."""
        return batches

    def around_backward(self) -> contextlib.AbstractContextManager[None]:
        """A context entered around ``accelerator.backward`` (and ``pipeline_step``)."""
        return _NOTHING

    def around_optimizer_step(self, optimizer: object) -> contextlib.AbstractContextManager[None]:
        """A context entered around a synchronising ``optimizer.step()`` of a prepared ``optimizer`` (not on
        the micro-steps of gradient accumulation)."""
        return _NOTHING

    def before_clip(self) -> None:
        """The step's gradients are about to be clipped (``accelerator.clip_grad_norm_``): a layer that changes
        them before they are applied does so here, so that the norm is the one of the step's gradients (fault
        tolerance averages them over the replica groups here instead of in :meth:`commit`)."""
        return None

    def clip_grad_norm_(self, parameters: list[Any], max_norm: float, norm_type: float) -> Any:
        """Clip ``parameters``' gradients instead of the backend and return their total norm (a tensor), or
        None to leave the clip to the backend (the default). For a layer that distributes gradients in a way
        the backend does not know (expert parallelism: each rank holds other experts' gradients, so the norm
        is reduced over the ranks). The first hook that answers clips; runs after :meth:`before_clip`."""
        return None

    def before_checkpoint(self, operation: str) -> None:
        """The model's weights are about to be written or read (``operation``: ``"save_state"``,
        ``"load_state"``, ``"save_model"`` or ``"get_state_dict"``), on every process, before any file is
        written or read: a layer whose weights the backend's checkpoint does not capture as they are gathers
        them here (expert parallelism collects every rank's experts, so the files hold the one-process layout),
        or raises saying why, instead of a checkpoint that silently lacks them."""
        return None

    def commit(self, optimizer: object) -> bool:
        """Whether the synchronising step of the prepared ``optimizer`` is applied, asked once per step with
        the gradients final, before the wrapped optimizer uses them. False discards the step: the weights,
        the optimizer's state and the prepared schedulers stay, and ``accelerator.optimizer_step_was_skipped``
        is True. Every hook is asked, also after one said False (a layer may take part in a collective here:
        fault tolerance averages the gradients over the replica groups and asks them all). Not asked where
        the model's engine steps inside ``backward`` (DeepSpeed)."""
        return True


def _overrides(hook: StepHook, moment: str) -> bool:
    return getattr(type(hook), moment) is not getattr(StepHook, moment)


@final
class _Nested:
    """The contexts of several hooks as one: entered in order, exited in reverse (even on errors)."""

    __slots__ = ("_contexts",)

    def __init__(self, contexts: list[contextlib.AbstractContextManager[None]]) -> None:
        self._contexts = contexts

    def __enter__(self) -> None:
        entered: list[contextlib.AbstractContextManager[None]] = []
        try:
            for context in self._contexts:
                context.__enter__()
                entered.append(context)
        except BaseException as error:
            for context in reversed(entered):
                context.__exit__(type(error), error, error.__traceback__)
            raise

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        for context in reversed(self._contexts):
            context.__exit__(kind, error, tb)


@final
class StepHooks:
    """The Accelerator's list of step hooks, run in the order they were added (contexts are exited in
    reverse). The prepared optimizers and loaders hold this one object, so a hook added after ``prepare``
    acts on them too (a loader from the next iteration it starts).

    Args:
        hooks: the hooks to start with.
    """

    def __init__(self, hooks: Iterable[StepHook] = ()) -> None:
        self._hooks: list[StepHook] = []
        self._index()
        for hook in hooks:
            self.add(hook)

    # Shared, never copied: a copy of a prepared loader or optimizer runs the same hooks.
    def __copy__(self) -> StepHooks:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> StepHooks:
        return self

    def add(self, hook: StepHook) -> None:
        """Run ``hook`` on every step from now on, after the hooks added before it."""
        if not isinstance(hook, StepHook):
            raise TypeError(
                f"add_step_hook({hook!r}) is invalid: a step hook is an instance of a subclass of "
                "lockstep.step_hooks.StepHook (override the moments it acts on)."
            )
        if any(hook is added for added in self._hooks):
            raise ValueError(f"add_step_hook({hook!r}): this hook runs already; add it once.")
        self._hooks.append(hook)
        self._index()

    def remove(self, hook: StepHook) -> None:
        """Stop running ``hook``."""
        self._hooks = [added for added in self._hooks if added is not hook]
        self._index()

    def __iter__(self) -> Iterator[StepHook]:
        return iter(list(self._hooks))

    def __len__(self) -> int:
        return len(self._hooks)

    def _index(self) -> None:
        # Per moment, the hooks that act on it: a moment no hook overrides costs one empty check per step.
        hooks = self._hooks
        self._batching = [hook for hook in hooks if _overrides(hook, "batches")]
        self._backward = [hook for hook in hooks if _overrides(hook, "around_backward")]
        self._stepping = [hook for hook in hooks if _overrides(hook, "around_optimizer_step")]
        self._committing = [hook for hook in hooks if _overrides(hook, "commit")]
        self._clipping = [hook for hook in hooks if _overrides(hook, "before_clip")]
        self._clippers = [hook for hook in hooks if _overrides(hook, "clip_grad_norm_")]

    def capability(self, kind: type[C]) -> C | None:
        """The first hook that is a ``kind`` (a layer may provide one of the capabilities of
        :mod:`lockstep.backends.capabilities`, as fault tolerance provides live recovery), or None."""
        return next((hook for hook in self._hooks if isinstance(hook, kind)), None)

    # -- the moments, as the Accelerator and the prepared objects run them ------------------------------
    def preparing_model(self, model: Any) -> Any:
        """``model`` as every hook changed it, in the order they were added."""
        for hook in self._hooks:
            model = hook.preparing_model(model)
        return model

    def prepared_model(self, model: object) -> None:
        for hook in self._hooks:
            hook.prepared_model(model)

    def prepared_optimizer(self, optimizer: object) -> None:
        for hook in self._hooks:
            hook.prepared_optimizer(optimizer)

    def before_clip(self) -> None:
        for hook in self._clipping:
            hook.before_clip()

    def before_checkpoint(self, operation: str) -> None:
        for hook in self._hooks:
            hook.before_checkpoint(operation)

    def clip_grad_norm_(self, parameters: list[Any], max_norm: float, norm_type: float) -> Any:
        """The total norm from the first hook that clips (see :meth:`StepHook.clip_grad_norm_`), else None."""
        for hook in self._clippers:
            norm = hook.clip_grad_norm_(parameters, max_norm, norm_type)
            if norm is not None:
                return norm
        return None

    def batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches`` as every hook wraps them (the first hook added wraps innermost)."""
        for hook in self._batching:
            batches = hook.batches(batches)
        return batches

    def around_backward(self) -> contextlib.AbstractContextManager[None]:
        hooks = self._backward
        if not hooks:
            return _NOTHING
        if len(hooks) == 1:
            return hooks[0].around_backward()
        return _Nested([hook.around_backward() for hook in hooks])

    def around_optimizer_step(self, optimizer: object) -> contextlib.AbstractContextManager[None]:
        hooks = self._stepping
        if not hooks:
            return _NOTHING
        if len(hooks) == 1:
            return hooks[0].around_optimizer_step(optimizer)
        return _Nested([hook.around_optimizer_step(optimizer) for hook in hooks])

    @property
    def decides_commits(self) -> bool:
        """Whether a hook answers :meth:`commit` (then a step's gradients must be final before it)."""
        return bool(self._committing)

    def commit(self, optimizer: object) -> bool:
        """Whether every hook applies the step of ``optimizer`` (all are asked, see :meth:`StepHook.commit`)."""
        return all([hook.commit(optimizer) for hook in self._committing])


__all__ = ["LayerSpec", "StepHook", "StepHooks", "register_layer", "unregister_layer"]
