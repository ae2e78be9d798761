"""Small deterministic models for the big-model inference tests (tests/big_modeling/)."""

from __future__ import annotations

import torch
from torch import nn

IDS = torch.arange(12) % 16


class Net(nn.Module):
    """Blocks with a head tied to the embedding, a BatchNorm (persistent buffers) and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8)) for _ in range(4)]
        )
        self.norm = nn.BatchNorm1d(8).eval()
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(ids)))) * self.scale


def make_net(seed: int = 0) -> Net:
    """A :class:`Net` with the weights of ``seed`` and a non-zero running mean."""
    torch.manual_seed(seed)
    net = Net()
    with torch.no_grad():
        net.norm.running_mean.fill_(0.1)
    return net


class Block(nn.Module):
    """A residual MLP block (the unit a device map never splits)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, width)
        self.down = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Tower(nn.Module):
    """``depth`` blocks of width ``width``: 2 * (width**2 + width) * 4 bytes per block in fp32."""

    def __init__(self, depth: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x
