"""Fewer bytes on the wire: gradients quantized blockwise for the reduction (ZeRO++'s qgZ).

With ``Policy(grad_quantization=ff.QuantizedReduce())`` each unit's reduce-scatter becomes
an all-to-all of int8 blocks: every rank quantizes the block of each parameter's gradient
that rank ``k`` owns (blocks of ``block_size`` elements starting at that block, one float32
scale each, as :class:`~functional_fsdp.QuantizedGather` does), sends it to rank ``k``, and
sums what it receives after dequantizing in float32 (float64 for float64 gradients). So
each rank's reduced shard is ``sum over ranks r of dequantize(quantize(rank r's block))``,
divided as the exact reduction is (:func:`quantize_blockwise`,
:func:`dequantize_blockwise`).

One hop over the reduced axis: ZeRO++'s hierarchical version (within the node, then across,
requantizing between hops) and its 4-bit option are not built; neither is error feedback.
The all-to-all runs over the axis's own group; reductions are not left in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..distributed import collectives as C
from ..distributed.axes import axis_sizes
from .quantized_gather import QuantizedGather, _compute_dtype, check_block_size


@dataclass(frozen=True)
class QuantizedReduce:
    """Reduce gradients as blockwise int8 through an all-to-all (ZeRO++'s qgZ): a
    :class:`~functional_fsdp.Policy` option.

    Attributes:
        block_size: elements per block, each with one float32 scale (the block's largest
            magnitude / 127): ``1 + 4 / block_size`` bytes per element sent.

    Example:
        >>> import functional_fsdp as ff
        >>> ff.Policy(grad_quantization=ff.QuantizedReduce(block_size=128)).grad_quantization
        QuantizedReduce(block_size=128)
    """

    block_size: int = 256

    def __post_init__(self) -> None:
        check_block_size(self)

    def reduce(
        self,
        flat: torch.Tensor,
        numels: Sequence[int],
        mesh: DeviceMesh,
        axis: str,
        *,
        counters: C.Counters = None,
    ) -> torch.Tensor:
        """``flat`` (``[n, total]``: row ``k`` for rank ``k``, each row the pieces' blocks of
        ``numels`` elements) summed over the ranks of ``axis`` as int8 blocks: this rank's
        row of the sum, ``[total]``, in ``flat``'s dtype."""
        n = flat.shape[0]
        codec = QuantizedGather(self.block_size)
        rows = []
        for k in range(n):
            row, offset = [], 0
            for numel in numels:
                row.append(flat[k, offset : offset + numel])
                offset += numel
            rows.append(codec.pack(row))
        size = rows[0].numel()
        group = mesh if len(axis_sizes(mesh)) == 1 else mesh[axis]
        got = C.raw_all_to_all(torch.cat(rows), group, [size] * n, [size] * n, counters=counters)
        compute = _compute_dtype(flat.dtype)
        return codec.unpack(got.view(n, size), numels, compute).sum(0).to(flat.dtype)
