"""Big-model inference, the code under Accelerate's ``accelerate.big_modeling``, ``accelerate.hooks`` and
``accelerate.inference`` paths: hooks that wrap a module's forward (:mod:`.module_hooks`), the hooks that move
weights between devices (:mod:`.device_hooks`) and attach them to a model (:mod:`.attach_hooks`), dispatching
a model over devices, CPU memory and disk (:mod:`.dispatch`), loading a checkpoint straight into that
placement (:mod:`.checkpoint_dispatch`), and pipelined inference (:mod:`.pipeline_inference`).

Nothing is imported here; :mod:`lockstep.big_modeling`, :mod:`lockstep.hooks` and :mod:`lockstep.inference`
are the public import paths.
"""
