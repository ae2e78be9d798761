"""Trains a tiny transformers Llama on whatever N-D layout the launcher configured (``--parallelism-config-*``).

Every process builds the same model and feeds the same batches (processes of one tensor-parallel group must
see the same inputs); the main process writes what it saw to the JSON file named on the command line.
"""

import json
import sys

import torch
from tests.helpers.fsdp_models import full_params
from transformers import LlamaConfig, LlamaForCausalLM

from lockstep import Accelerator

accelerator = Accelerator()
torch.manual_seed(0)
model = LlamaForCausalLM(
    LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
generator = torch.Generator().manual_seed(1)
losses = []
for _ in range(3):
    ids = torch.randint(0, 64, (4, 16), generator=generator)
    loss = model(input_ids=ids, labels=ids).loss
    losses.append(float(loss.detach()))
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
config = accelerator.parallelism_config
report = {
    "world": accelerator.num_processes,
    "losses": losses,
    "params": full_params(model).tolist(),
    "mesh": list(accelerator.torch_device_mesh.mesh_dim_names) if accelerator.torch_device_mesh else None,
    "tp_size": config.tp_size if config else None,
    "tp_ranks": accelerator.gather(
        torch.tensor([accelerator.tensor_parallel_rank if config else 0])
    ).tolist(),
}
accelerator.wait_for_everyone()
if accelerator.is_main_process:
    json.dump(report, open(sys.argv[1], "w"))
accelerator.end_training()
