"""Run debug_launcher from a fresh interpreter and print one JSON line with what happened.

Usage: debug_launch.py sum OUT_FILE | debug_launch.py fail

Forking workers from a long-lived process with many threads (a test session, a notebook) risks that a
child inherits a lock some thread held at the fork; the launcher tests run here, from a clean process.
"""

import json
import sys

from lockstep import debug_launcher


def sum_ranks(path: str) -> None:
    import torch

    from lockstep import Accelerator

    accelerator = Accelerator()
    total = accelerator.reduce(torch.tensor([accelerator.process_index + 1.0]), reduction="sum")
    if accelerator.is_main_process:
        with open(path, "w") as handle:
            handle.write(f"{accelerator.num_processes} {total.item():.0f} {accelerator.device}")


def fail_on_rank_one() -> None:
    from lockstep import Accelerator

    accelerator = Accelerator()
    if accelerator.process_index == 1:
        raise KeyError("missing column 'label' on rank one")
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    if sys.argv[1] == "sum":
        debug_launcher(sum_ranks, args=(sys.argv[2],), num_processes=3)
        print(json.dumps({"ok": True}))
    else:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        from lockstep.launcher import WorkerFailedError

        try:
            debug_launcher(fail_on_rank_one, num_processes=2)
        except ChildFailedError as error:  # what Accelerate's launchers raise
            print(
                json.dumps(
                    {
                        "is_lockstep_error": isinstance(error, WorkerFailedError),
                        "is_runtime_error": isinstance(error, RuntimeError),
                        "failed_ranks": list(error.failures),
                        "first": error.get_first_failure()[0],
                        "text": str(error),
                    }
                )
            )
