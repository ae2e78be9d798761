"""The 4.7M-parameter workload the FSDP, DeepSpeed and tensor-parallel benchmarks share: 4 residual MLP
blocks of width 384 (LayerNorm, up to 4x, ReLU, down) and a 10-class head, batches of 32 random inputs."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

WIDTH, DEPTH, BATCH = 384, 4, 32


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def make_model() -> nn.Module:
    """The blocks and the head as one ``nn.Sequential``, seeded."""
    torch.manual_seed(0)
    return nn.Sequential(*[Layer() for _ in range(DEPTH)], nn.Linear(WIDTH, 10))


def batches(seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs, class labels) batches; processes that must see the same data pass the same seed."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield (
            torch.randn(BATCH, WIDTH, generator=generator),
            torch.randint(0, 10, (BATCH,), generator=generator),
        )
