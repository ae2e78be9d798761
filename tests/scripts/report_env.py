"""Print what a worker sees: rank, world size, threads, and settings handed down by the launcher."""

import json
import os
import sys

from lockstep import Accelerator

accelerator = Accelerator()
info = {
    "rank": accelerator.process_index,
    "world": accelerator.num_processes,
    "type": str(accelerator.distributed_type),
    "threads": os.environ.get("OMP_NUM_THREADS"),
    "mixed_precision": accelerator.mixed_precision,
    "accumulation": accelerator.gradient_accumulation_steps,
    "argv": os.sys.argv[1:],
}
sys.stdout.write("REPORT " + json.dumps(info) + "\n")  # one write: ranks share the pipe
sys.stdout.flush()
accelerator.end_training()
