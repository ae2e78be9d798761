"""A small transformer-shaped model for FSDP tests: repeated ``TinyDecoderLayer`` blocks."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

WIDTH, DEPTH, FEATURES = 32, 3, 8


class TinyDecoderLayer(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class TinyTransformer(nn.Module):
    _no_split_modules = ["TinyDecoderLayer"]

    def __init__(self, width: int = WIDTH, depth: int = DEPTH) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, width)
        self.layers = nn.ModuleList(TinyDecoderLayer(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)
        self.register_buffer("scale", torch.tensor(0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h) * self.scale


def make_transformer(seed: int = 0, **sizes: int) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer(**sizes)


def make_data(length: int = 48, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(length, FEATURES, generator=generator)
    y = x.sum(dim=1, keepdim=True) * 0.1 + 0.05 * torch.randn(length, 1, generator=generator)
    return TensorDataset(x, y)


def data_loader(length: int, batch_size: int) -> DataLoader:
    return DataLoader(make_data(length), batch_size=batch_size)


def loss_of(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def full_params(model: nn.Module) -> torch.Tensor:
    """Every parameter, gathered whole when sharded, flattened in order (call on every rank)."""
    tensors = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    return torch.cat([t.detach().float().reshape(-1).cpu() for t in tensors])


def reference_run(
    length: int,
    global_batch: int,
    steps_per_epoch_cap: int | None = None,
    *,
    lr: float = 0.1,
    epochs: int = 2,
    accumulation: int = 1,
    clip: float | None = None,
    adamw: bool = False,
) -> tuple[torch.Tensor, list[float]]:
    """One process, plain PyTorch and SGD on the global batch; returns (parameters, gradient norms)."""
    data = make_data(length)
    model = make_transformer()
    optimizer = (
        torch.optim.AdamW(model.parameters(), lr=1e-2)
        if adamw
        else torch.optim.SGD(model.parameters(), lr=lr)
    )
    norms: list[float] = []
    micro = global_batch // accumulation
    for _ in range(epochs):
        for start in range(0, length, global_batch):
            for m in range(accumulation):
                batch = data[start + m * micro : start + (m + 1) * micro]
                (loss_of(model, batch) / accumulation).backward()
            if clip is not None:
                norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip)))
            optimizer.step()
            optimizer.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), norms
