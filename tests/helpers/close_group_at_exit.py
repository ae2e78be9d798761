"""Run a script as ``__main__``, then close its process group before the interpreter exits.

transformers' example scripts never call ``destroy_process_group()``; with a gloo group still alive at
interpreter exit a rank sometimes dies with SIGABRT ("terminate called without an active exception",
pytorch/pytorch#190489), after the script has finished and written everything. That turned the
reference runs of ``tests/e2e/test_trainer_scripts.py`` (transformers.Trainer under torchrun) red about
once in 20 runs. This runner leaves the script unchanged and does, after it, what lockstep does at exit:
collect garbage, barrier, destroy the group, leave with ``os._exit`` so no C++ destructor runs afterwards.

Usage: ``python -m torch.distributed.run ... close_group_at_exit.py SCRIPT ARGS...``
"""

from __future__ import annotations

import gc
import os
import runpy
import sys


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as if the script were run: not this folder
    runpy.run_path(script, run_name="__main__")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
