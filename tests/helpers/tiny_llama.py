"""A tiny transformers ``LlamaForCausalLM`` (4 layers, hidden 32, vocab 64) and token data, for pipeline tests."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from tests.helpers.llama import tiny_llama_config

VOCAB, SEQUENCE = 64, 16


def make_llama(seed: int = 0, *, tie_word_embeddings: bool = False, layers: int = 4):
    """A fresh tiny Llama of ``layers`` layers (:func:`tests.helpers.llama.tiny_llama_config`, no dropout,
    ``use_cache`` left at its default, True), ``sdpa`` attention, with the weights of ``seed``."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(
        num_hidden_layers=layers, attention_dropout=0.0, tie_word_embeddings=tie_word_embeddings
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


def token_ids(length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length, SEQUENCE), generator=generator)


def token_data(length: int, seed: int = 0) -> TensorDataset:
    """``(input_ids, labels)`` pairs; the labels are the inputs (the model shifts them)."""
    ids = token_ids(length, seed)
    return TensorDataset(ids, ids.clone())


def padded_mask(length: int) -> torch.Tensor:
    """An attention mask with padding: every other row right-padded after 10 tokens, the others left-padded
    over their first 3."""
    mask = torch.ones(length, SEQUENCE, dtype=torch.long)
    mask[0::2, 10:] = 0
    mask[1::2, :3] = 0
    return mask
