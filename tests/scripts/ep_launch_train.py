"""Trains tiny Qwen3-MoE with whatever expert parallelism the launcher configured (``--parallelism-config-ep-size``)
through the user's loop (:mod:`tests.expert_parallel.accelerator_loop`); each process saves what it saw with
``torch.save`` to ``<path>.rank<N>``, the path named on the command line."""

import sys

import torch
from tests.expert_parallel.accelerator_loop import train

from lockstep import Accelerator

accelerator = Accelerator(gradient_accumulation_steps=2)
result = train(accelerator)
config = accelerator.parallelism_config
result["ep_size"] = None if config is None else config.ep_size
torch.save(result, f"{sys.argv[1]}.rank{accelerator.process_index}")
accelerator.end_training()
