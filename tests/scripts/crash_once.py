"""Rank 1 crashes on the first attempt; after the elastic restart every rank trains and agrees."""

import os
import sys

import torch

from lockstep import Accelerator

accelerator = Accelerator()
if accelerator.process_index == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    sys.exit(3)
total = accelerator.reduce(torch.tensor([float(accelerator.process_index + 1)]), reduction="sum")
accelerator.print(f"attempt {os.environ['TORCHELASTIC_RESTART_COUNT']} sum {total.item():.0f}")
accelerator.end_training()
