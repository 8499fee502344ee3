"""Shared by the examples: the bundled text, mesh parsing and sampling."""

from __future__ import annotations

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


def random_batch(data: torch.Tensor, batch: int, block: int, gen: torch.Generator) -> torch.Tensor:
    """``batch`` random windows of ``block + 1`` characters (inputs and shifted targets)."""
    starts = torch.randint(0, len(data) - block - 1, (batch,), generator=gen)
    return torch.stack([data[s : s + block + 1] for s in starts.tolist()])
