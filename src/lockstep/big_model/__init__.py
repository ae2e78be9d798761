"""Big-model inference, the engine under Accelerate's ``accelerate.big_modeling`` path: dispatching a model
over devices, CPU memory and disk (:mod:`.dispatch`), and loading a checkpoint straight into that placement
(:mod:`.checkpoint_dispatch`).

Nothing is imported here; :mod:`lockstep.big_modeling` is the public import path.
"""
