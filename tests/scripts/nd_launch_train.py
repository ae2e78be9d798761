"""Trains a tiny transformers Llama on whatever N-D layout the launcher configured (``--parallelism-config-*``).

Every process builds the same model and feeds the same batches (processes of one tensor- or context-parallel
group must see the same inputs); with ``cp_size > 1`` each step runs in ``maybe_context_parallel``, which
splits the batch along the sequence (so the labels are shifted beforehand). The main process writes what it
saw to the JSON file named on the command line.
"""

import contextlib
import json
import sys

import torch
import torch.nn.functional as F
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
config = accelerator.parallelism_config
context_parallel = config is not None and config.cp_enabled
for _ in range(3):
    tokens = torch.randint(0, 64, (4, 17), generator=generator)
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(16).expand_as(ids).contiguous()
    with (
        accelerator.maybe_context_parallel(buffers=[ids, labels, positions], buffer_seq_dims=[1, 1, 1])
        if context_parallel
        else contextlib.nullcontext()
    ):
        logits = model(input_ids=ids, position_ids=positions).logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        accelerator.backward(loss)
    # the mean over the processes: the same loss on every tp rank, each cp rank's over its chunks
    losses.append(float(accelerator.gather(loss.detach()[None]).mean()))
    optimizer.step()
    optimizer.zero_grad()
report = {
    "world": accelerator.num_processes,
    "losses": losses,
    "params": full_params(model).tolist(),
    "mesh": list(accelerator.torch_device_mesh.mesh_dim_names) if accelerator.torch_device_mesh else None,
    "tp_size": config.tp_size if config else None,
    "cp_comm_strategy": config.cp_handler.cp_comm_strategy if context_parallel else None,
    "cp_ranks": accelerator.gather(
        torch.tensor([accelerator.context_parallel_rank if config else 0])
    ).tolist(),
    "tp_ranks": accelerator.gather(
        torch.tensor([accelerator.tensor_parallel_rank if config else 0])
    ).tolist(),
}
accelerator.wait_for_everyone()
if accelerator.is_main_process:
    json.dump(report, open(sys.argv[1], "w"))
accelerator.end_training()
