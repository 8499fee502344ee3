"""Small reference models for examples, tests and benchmarks.

``GPT`` is a decoder-only transformer: token and position embeddings, ``n_layer`` blocks of
causal self-attention and an MLP, a final norm, and an LM head tied to the token embedding.
Attention reads the local head count from the projection's output shape, so the same code
runs with tensor-parallel (head-split) weights.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ..cp.attention import attention as cp_attention
from ..cp.attention import positions
from ..tp.styles import (
    ColwiseParallel,
    PrepareInput,
    RowwiseParallel,
    ScatterOutput,
    SequenceParallel,
    Style,
    VocabParallelEmbedding,
)


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """GPT hyperparameters.

    Attributes:
        vocab_size: number of tokens.
        block_size: maximum sequence length.
        n_layer: transformer blocks.
        n_head: attention heads.
        n_embd: model width (divisible by ``n_head``).
        mlp_ratio: MLP hidden width over ``n_embd``.
        dropout: dropout probability on the embeddings and on each residual branch (in
            training mode), as nanoGPT's ``resid_pdrop``.
    """

    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    mlp_ratio: int = 4
    dropout: float = 0.0


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.wq = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.wk = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.wv = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.wo = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # h is read from the shape: the local head count under tensor parallelism.
        q, k, v = (
            rearrange(w(x), "b t (h d) -> b h t d", d=self.head_dim)
            for w in (self.wq, self.wk, self.wv)
        )
        # Causal attention; over the whole sequence where a "cp" axis splits it (ff.cp).
        y = cp_attention(q, k, v)
        return self.wo(rearrange(y, "b h t d -> b t (h d)"))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """A small GPT with the LM head tied to the token embedding.

    Example:
        >>> model = GPT(GPTConfig(n_layer=1))
        >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 256])
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        # Global positions: this rank's chunks of the sequence under context parallelism.
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions(t, idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of ``logits`` against ``targets`` already shifted by one
    (``targets = ids[:, 1:]`` for ``logits`` of ``ids[:, :-1]``), every token counted.

    For Hugging Face's convention (labels aligned with ``input_ids``, ``-100`` where a token
    does not count, a ``(sum, count)`` the step divides over the global batch) use
    :func:`functional_fsdp.causal_lm_loss`; ``causal_lm_loss(logits, shift_labels=targets)``
    is this loss as a ``SumCount``.

    Example:
        >>> import torch
        >>> float(lm_loss(torch.zeros(1, 3, 4), torch.tensor([[0, 1, 2]])))  # log 4
        1.3862943649291992
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class MLPModel(nn.Module):
    """A plain MLP (a stack of ``Linear`` + ``tanh``) with deliberately uneven sizes."""

    def __init__(self, sizes: tuple[int, ...] = (7, 13, 5, 3)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(sizes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


def gpt_plan(
    cfg: GPTConfig, *, sequence_parallel: bool = False, loss_parallel: bool = True
) -> dict[str, Style]:
    """The TP plan of :class:`functional_fsdp.models.GPT` (Megatron-style).

    Attention heads and the MLP hidden units are split over tp (q, k, v and ``fc1``
    colwise, ``wo`` and ``fc2`` rowwise, one :class:`PrepareInput` per block half); the token
    embedding is vocab-parallel and the tied head colwise over the vocabulary.

    Args:
        cfg: the model's config (for the head size).
        sequence_parallel: keep the residual stream split along the sequence between the
            blocks (norms run on a part of the sequence; the block boundaries all-gather and
            reduce-scatter instead of all-reducing).
        loss_parallel: leave the logits split over the vocabulary, for
            :func:`vocab_parallel_cross_entropy`; ``False`` all-gathers them for an
            ordinary loss.

    Example:
        >>> from functional_fsdp.models import GPTConfig
        >>> sorted(gpt_plan(GPTConfig()))[:3]
        ['blocks.*.attn', 'blocks.*.attn.w[qkv]', 'blocks.*.attn.wo']
    """
    sp = sequence_parallel
    seq: Literal["replicated", "sequence"] = "sequence" if sp else "replicated"
    plan: dict[str, Style] = {
        "tok_emb": VocabParallelEmbedding(output=seq),
        "blocks.*.attn": PrepareInput(sequence_dim=1 if sp else None),
        "blocks.*.attn.w[qkv]": ColwiseParallel(
            input="prepared", head_dim=cfg.n_embd // cfg.n_head
        ),
        "blocks.*.attn.wo": RowwiseParallel(output=seq),
        "blocks.*.mlp": PrepareInput(sequence_dim=1 if sp else None),
        "blocks.*.mlp.fc1": ColwiseParallel(input="prepared"),
        "blocks.*.mlp.fc2": RowwiseParallel(output=seq),
        "head": ColwiseParallel(
            input="sequence" if sp else "replicated",
            output="sharded" if loss_parallel else "replicated",
        ),
    }
    if sp:
        plan.update(
            {
                "pos_emb": ScatterOutput(dim=0),
                "blocks.*.ln[12]": SequenceParallel(),
                "ln_f": SequenceParallel(),
            }
        )
    return plan
