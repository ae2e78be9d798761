"""The DeepSpeed backend (``pip install 'lockstep[deepspeed]'``): ZeRO stages 0-3 on DeepSpeed's engine.

The backend is :class:`lockstep.backends.deepspeed.backend.DeepSpeedBackend`; this package imports nothing
on its own, so that ``DummyOptim`` and ``DummyScheduler`` load without torch.distributed or DeepSpeed.
"""
