"""A small regression problem and a hand-written reference loop for parity tests."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FEATURES = 6


def make_dataset(length: int, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(length, FEATURES, generator=generator)
    weight = torch.arange(1.0, FEATURES + 1)
    y = (x @ weight).unsqueeze(1) * 0.1 + 0.05 * torch.randn(length, 1, generator=generator)
    return TensorDataset(x, y)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()])


def reference_training(
    length: int,
    global_batch: int,
    epochs: int,
    *,
    lr: float = 0.1,
    shuffle_seed: int | None = None,
    accumulation: int = 1,
) -> torch.Tensor:
    """One process, plain PyTorch, SGD on global batches (micro-batches of global_batch // accumulation).

    With ``shuffle_seed``, epoch e visits ``torch.randperm(length, generator=seed + e)``.
    """
    dataset = make_dataset(length)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for epoch in range(epochs):
        if shuffle_seed is None:
            order = torch.arange(length)
        else:
            order = torch.randperm(length, generator=torch.Generator().manual_seed(shuffle_seed + epoch))
        micro = global_batch // accumulation
        for start in range(0, length, global_batch):
            for m in range(accumulation):
                idx = order[start + m * micro : start + (m + 1) * micro]
                loss = loss_fn(model, dataset[idx]) / accumulation
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return flat_params(model)


def loader(length: int, batch_size: int, *, shuffle: bool = False, drop_last: bool = False) -> DataLoader:
    return DataLoader(make_dataset(length), batch_size=batch_size, shuffle=shuffle, drop_last=drop_last)
