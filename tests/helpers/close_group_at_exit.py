"""The one remedy of the tests for the gloo abort at interpreter exit: close the process group, then leave.

With a gloo group still alive at interpreter exit a rank sometimes dies with SIGABRT ("terminate called
without an active exception", pytorch/pytorch#190489), after the script has finished and written
everything. That turned the reference runs of ``tests/e2e/test_trainer_scripts.py`` (transformers.Trainer
under torchrun) red about once in 20 runs. :func:`close_group` does what lockstep does at exit: collect
garbage, barrier, destroy the group, leave with ``os._exit`` so no C++ destructor runs afterwards.

Who uses it: every test process that may hold a group lockstep did not make.

* A script lockstep's ``Accelerator`` (or ``Trainer``) runs in needs nothing: the product registers the same
  teardown at exit when it makes or adopts the group (``lockstep._process_group``), and
  ``run_distributed``'s workers end the group the same way, then leave with ``os._exit``.
* A script or module run under torchrun that lockstep does not own (transformers' examples, Accelerate's
  reference snippets, a module that runs transformers.Trainer): this file as the entry point, unchanged
  script after it: ``python -m torch.distributed.run ... close_group_at_exit.py SCRIPT ARGS...`` or
  ``... close_group_at_exit.py -m MODULE ARGS...``.
"""

from __future__ import annotations

import gc
import os
import runpy
import sys

RUNNER = os.path.abspath(__file__)
"""This file's path: the entry point to give torchrun before the script."""


def close_group() -> None:
    """Destroy the default process group if one is alive, flush the streams, and leave with ``os._exit(0)``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    if sys.argv[1] == "-m":
        module = sys.argv[2]
        sys.argv = [module, *sys.argv[3:]]
        sys.path[0] = os.getcwd()  # as under ``python -m``: the working directory, not this folder
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script = sys.argv[1]
        sys.argv = sys.argv[1:]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as if the script were run: not this folder
        runpy.run_path(script, run_name="__main__")
    close_group()


if __name__ == "__main__":
    main()
