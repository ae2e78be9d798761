"""How far expert-parallel ranks' results are from one process's: shared by the replica and FSDP2 parity tests."""

from __future__ import annotations

from typing import Any

import torch

EP_SIZE = 2


def expected_rows(full: torch.Tensor, name: str, rank: dict[str, Any]) -> torch.Tensor:
    """The reference's tensor ``name``; for experts, the rows ``rank`` holds (``rank["first"]``: each experts
    module's first expert on that rank)."""
    if ".experts." not in name:
        return full
    first = rank["first"][name.rsplit(".experts.", 1)[0] + ".experts"]
    return full[first : first + full.shape[0] // EP_SIZE]


def differences(reference: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, float]:
    """The largest differences of the mean loss, the parameters (experts: each rank's rows) and, where the
    reference logged them, the aux losses and the clip norms."""
    losses = torch.tensor([r["losses"] for r in ranks]).mean(dim=0)
    worst = 0.0
    for rank in ranks:
        assert rank["state"].keys() == reference["state"].keys()
        for name, full in reference["state"].items():
            expected = expected_rows(full, name, rank)
            assert rank["state"][name].shape == expected.shape, name
            worst = max(worst, (rank["state"][name] - expected).abs().max().item())
    diff = {"loss": (losses - torch.tensor(reference["losses"])).abs().max().item(), "params": worst}
    for key, logged in (("aux", "aux"), ("norm", "norms")):
        if logged in reference:  # the Trainer logs no aux loss (its loss holds it)
            diff[key] = max(
                (torch.tensor(r[logged]) - torch.tensor(reference[logged])).abs().max().item() for r in ranks
            )
    return diff
