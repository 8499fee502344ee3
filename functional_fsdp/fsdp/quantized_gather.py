"""Fewer bytes on the wire: weights quantized blockwise for the all-gather (ZeRO++'s qwZ).

With ``Policy(gather_quantization=ff.QuantizedGather())`` each unit's all-gather sends its
shards as int8 values in blocks of ``block_size`` elements, each block with one float32
scale (its absolute maximum / 127), in the same collective; the receiver dequantizes to the
compute dtype. Per element that is ``1 + 4 / block_size`` bytes instead of 4 (fp32) or 2
(bf16): about 0.25× and 0.51× at the default block of 256.

Only the gathered copy is approximate: the shards at rest (the master weights, the
optimizer's, the checkpoints') stay exact, and the gradients are those of the dequantized
weights (a straight-through estimator, as ZeRO++ trains). Blocks start at each parameter's
shard, so the step equals one process computing with ``dequantize(quantize(shard))`` for
every rank's shard of every parameter (:func:`quantize_blockwise`,
:func:`dequantize_blockwise`), and the recompute of a checkpointed unit and the backward's
gather see the same values as the forward. Only the first gather round of a parameter is
quantized (a dim split over two data axes gathers its minor axis exactly); integer tensors
(and 4-bit packed bases) are gathered as they are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


def _qmax(bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"bits={bits!r}: 8 (int8 values) or 4 (two values per byte).")
    return 2 ** (bits - 1) - 1


@dataclass(frozen=True)
class QuantizedGather:
    """Gather weights as blockwise int8 (ZeRO++'s qwZ): a :class:`~functional_fsdp.Policy`
    option.

    Attributes:
        block_size: elements per block, each with one float32 scale (the block's largest
            magnitude / 127). Smaller blocks follow outliers more closely and send more
            scales: ``4 / block_size`` bytes per element.

    Example:
        >>> import functional_fsdp as ff
        >>> policy = ff.Policy(gather_quantization=ff.QuantizedGather(block_size=128))
        >>> policy.gather_quantization.bytes_per_element()
        1.03125
    """

    block_size: int = 256

    def __post_init__(self) -> None:
        check_block_size(self)

    def bytes_per_element(self) -> float:
        """Bytes sent per gathered element: one int8 value plus its share of a scale."""
        return 1 + 4 / self.block_size

    def pack(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The shards as one uint8 buffer (:meth:`BlockCodec.pack` of int8 blocks)."""
        return BlockCodec(self.block_size).pack(shards)

    def unpack(
        self, gathered: torch.Tensor, numels: Sequence[int], dtype: torch.dtype
    ) -> torch.Tensor:
        """``[n, packed bytes]`` from the all-gather back to ``[n, sum(numels)]`` in
        ``dtype``: each rank's shards, dequantized, in order."""
        return BlockCodec(self.block_size).unpack(gathered, numels, dtype)


@dataclass(frozen=True)
class BlockCodec:
    """The wire format of blockwise quantized tensors: every block's float32 scale, then the
    values (int8, or two 4-bit values per byte, low nibble first, stored as ``q + 8``),
    zero-padded to a multiple of 4 bytes so that the receiver views, not copies.

    Example:
        >>> import torch
        >>> codec = BlockCodec(block_size=4, bits=4)
        >>> x = torch.tensor([0.7, -0.1, 0.0, 0.35, 1.0])
        >>> buffer = codec.pack([x])  # 2 scales (8 B), 2 blocks of 4 values (4 B)
        >>> buffer.dtype, buffer.numel()
        (torch.uint8, 12)
        >>> codec.unpack(buffer.view(1, -1), [5], torch.float32).tolist()  # steps of 0.1, 1/7
        [[0.699999988079071, -0.10000000149011612, 0.0, 0.4000000059604645, 1.0]]
    """

    block_size: int
    bits: int = 8

    def value_bytes(self, blocks: int) -> int:
        """Bytes of ``blocks`` blocks' values."""
        return blocks * self.block_size * self.bits // 8

    def pack(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """The pieces as one uint8 buffer; each piece's blocks start at its first element."""
        return self.pack_rows([p.detach().reshape(1, -1) for p in pieces])[0]

    def pack_rows(self, columns: Sequence[torch.Tensor]) -> torch.Tensor:
        """``n`` buffers as :meth:`pack` sends them, ``[n, packed bytes]``: buffer ``r`` holds
        row ``r`` of every piece in ``columns`` (each ``[n, numel]``), each piece quantized
        for all rows at once."""
        values, scales = [], []
        for piece in columns:
            q, scale = _quantize_rows(piece, self.block_size, self.bits)
            values.append(q)
            scales.append(scale.view(torch.uint8))
        packed = _to_bytes(torch.cat(values, dim=1), self.bits)
        size = packed.shape[1] + sum(s.shape[1] for s in scales)
        return torch.cat([*scales, packed, packed.new_zeros(packed.shape[0], -size % 4)], dim=1)

    def unpack(
        self, buffers: torch.Tensor, numels: Sequence[int], dtype: torch.dtype
    ) -> torch.Tensor:
        """``[n, packed bytes]`` (``n`` buffers of :meth:`pack`) back to ``[n, sum(numels)]``
        in ``dtype``: each buffer's pieces, dequantized, in order."""
        n, b = buffers.shape[0], self.block_size
        blocks = [math.ceil(k / b) for k in numels]
        n_scales = sum(blocks)
        scales = buffers[:, : 4 * n_scales].view(torch.float32)
        values = buffers[:, 4 * n_scales : 4 * n_scales + self.value_bytes(n_scales)]
        values = _from_bytes(values, self.bits)
        out, offset = [], 0
        for k, nb in zip(numels, blocks):
            q = values[:, offset * b : (offset + nb) * b].reshape(n, nb, b)
            deq = _dequantize(q, scales[:, offset : offset + nb], dtype)
            out.append(deq.reshape(n, nb * b)[:, :k])
            offset += nb
        return torch.cat(out, dim=1)


def _to_bytes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """``[n, values]`` int8 as the bytes sent: themselves, or two 4-bit ``q + 8`` per byte."""
    if bits == 8:
        return q.view(torch.uint8)
    u = (q + 8).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def _from_bytes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`_to_bytes` undone on ``[n, bytes]``: ``[n, values]`` int8."""
    if bits == 8:
        return packed.view(torch.int8)
    nibbles = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    return nibbles.to(torch.int8) - 8


def check_block_size(option: QuantizedGather | Any) -> None:
    """Refuse a block size that is not a positive int, naming the option."""
    b = option.block_size
    if not isinstance(b, int) or b < 1:
        raise ValueError(
            f"{type(option).__name__}(block_size={b!r}): a positive number of elements per "
            f"block (each block carries one float32 scale), e.g. 256."
        )


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def quantize_blockwise(
    x: torch.Tensor, block_size: int, *, bits: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` flattened, zero-padded to whole blocks: int8 values ``[blocks, block_size]``
    and one float32 scale per block (the block's largest magnitude / 127; 1 for an all-zero
    block). ``bits=4``: values in ``[-7, 7]``, the scale the largest magnitude / 7.

    Example:
        >>> import torch
        >>> q, scale = quantize_blockwise(torch.tensor([0.5, -1.0, 0.25]), 2)
        >>> q.tolist(), [round(v * 127, 6) for v in scale.tolist()]  # scale = largest / 127
        ([[64, -127], [127, 0]], [1.0, 0.25])
        >>> quantize_blockwise(torch.tensor([0.5, -1.0, 0.25]), 2, bits=4)[0].tolist()
        [[3, -7], [7, 0]]
    """
    q, scale = _quantize_rows(x.detach().reshape(1, -1), block_size, bits)
    return q.view(-1, block_size), scale[0]


def _quantize_rows(
    rows: torch.Tensor, block_size: int, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_blockwise` of each row of ``rows`` (``[n, k]``): int8 ``[n, blocks *
    block_size]`` and float32 scales ``[n, blocks]``."""
    qmax = _qmax(bits)
    x = rows.to(_compute_dtype(rows.dtype))
    pad = -x.shape[1] % block_size
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    blocks = x.view(x.shape[0], -1, block_size)
    amax = blocks.abs().amax(dim=2)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax)).to(torch.float32)
    q = (blocks / scale.to(blocks.dtype)[..., None]).round_().clamp_(-qmax, qmax)  # a new buffer
    return q.to(torch.int8).view(x.shape[0], -1), scale


def _dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    compute = _compute_dtype(dtype)
    return (q.to(compute) * scale.to(compute)[..., None]).to(dtype)


def dequantize_blockwise(q: torch.Tensor, scale: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The values :func:`quantize_blockwise` encoded, in ``like``'s shape and dtype.

    Example:
        >>> import torch
        >>> x = torch.tensor([0.5, -1.0, 0.25])
        >>> dequantize_blockwise(*quantize_blockwise(x, 2), x).tolist()
        [0.5039370059967041, -1.0, 0.25]
    """
    flat = _dequantize(q, scale, like.dtype).reshape(-1)[: like.numel()]
    return flat.view(like.shape)
