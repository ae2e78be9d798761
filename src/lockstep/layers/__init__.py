"""Layers: what acts around every training step beside the backend, through step hooks.

A layer is not a way to train (that is a backend, :mod:`lockstep.backends`): whichever backend trains, a
layer's :class:`~lockstep.step_hooks.StepHook` objects run before the forward, around the backward and the
optimizer step (with a say in whether the step commits), and when the step ends. Fault tolerance on torchft
(:mod:`lockstep.layers.fault_tolerance`) is one.

A layer is added in one of two ways, each registering a :class:`~lockstep.config.layer_specs.LayerSpec` (its
config type, ``Accelerator`` keyword, ``TrainingArguments`` field, config-file section, launch switch and hook
builder):

- a built-in layer is a folder here with a ``spec.py`` that calls
  :func:`~lockstep.config.layer_specs.register_layer` on import; the folder is found by
  :func:`lockstep.config.vocabulary.import_built_in_specs`, nothing lists it;
- an installed package declares its spec in the ``lockstep.layers`` entry-point group (or its code calls
  ``register_layer``).

This package imports nothing heavy on its own: ``lockstep launch`` reads the specs without torch.
"""
