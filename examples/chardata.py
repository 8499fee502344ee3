"""Shared by the examples: the bundled text, mesh parsing and sampling."""

from __future__ import annotations

import argparse
import pydoc_data.topics

import torch


def load_text() -> tuple[torch.Tensor, list[str]]:
    """Python's help topics (shipped with every install) as character ids, and the alphabet."""
    text = "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), chars


def parse_mesh(spec: str | None, default: dict[str, int]) -> dict[str, int]:
    """``"dp=2,tp=2"`` as ``{"dp": 2, "tp": 2}``; ``default`` when no spec is given."""
    if not spec:
        return default
    return {name: int(size) for name, size in (part.split("=") for part in spec.split(","))}


def add_device_arg(p: argparse.ArgumentParser) -> None:
    """``--device cuda|cpu``; the default is CUDA when a GPU is visible."""
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="where the model and data live (default: cuda when a GPU is visible, else cpu); "
        "each rank uses GPU LOCAL_RANK",
    )


def random_batch(
    data: torch.Tensor,
    batch: int,
    block: int,
    gen: torch.Generator,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``batch`` random windows of ``block + 1`` characters (inputs and shifted targets).

    Drawn on the host (the same on every rank), then copied to ``device`` from pinned memory
    without blocking, so the step that uses it needs no host synchronisation.
    """
    starts = torch.randint(0, len(data) - block - 1, (batch,), generator=gen)
    out = torch.stack([data[s : s + block + 1] for s in starts.tolist()])
    if torch.device(device).type == "cuda":
        return out.pin_memory().to(device, non_blocking=True)
    return out
