"""Fewer bytes on the wire: gradients quantized blockwise for the reduction (ZeRO++'s qgZ).

With ``Policy(grad_quantization=ff.QuantizedReduce())`` each unit's reduce-scatter becomes
an all-to-all of quantized blocks: every rank quantizes the block of each parameter's
gradient that rank ``k`` owns (blocks of ``block_size`` elements starting at that block, one
float32 scale each, as :class:`~functional_fsdp.QuantizedGather` does; int8 values, or 4-bit
ones with ``bits=4``), sends it to rank ``k``, and sums what it receives after dequantizing
in float32 (float64 for float64 gradients). So each rank's reduced shard is ``sum over
ranks r of dequantize(quantize(rank r's block))``, divided as the exact reduction is
(:func:`quantize_blockwise`, :func:`dequantize_blockwise`).

**Two hops** (ZeRO++'s hierarchical all-to-all). Where a unit's gradients are sharded over
two data axes (FSDP on ``{"node": N, "gpu": G}``: each dim split over ``("node", "gpu")``),
the exact reduction reduce-scatters over the major axis first. qgZ instead reduces over the
spec's minor axis first (``"gpu"``, within the node): rank ``(i, j)`` sends its neighbour
``j'`` the quantized blocks that every node's rank ``j'`` owns, and sums what it receives in
float32. It then requantizes those ``N`` partial sums and sends each, over the major axis,
to the node that owns it, which sums them. The major axis (between nodes) carries ``1/G`` of
the gradient instead of all of it; the intra-node hop carries it all. With
``hierarchical=False`` each axis's reduction is its own quantized hop, in the exact
reduction's order. Under hpZ (``reshard_after_forward="gpu"``) each dim is laid out over
``"gpu"`` first, so the exact order already goes within the node first: its rounds are the
two hops as they come.

The reduction over replicated axes (HSDP's ``replicate``, DDP) stays an exact all-reduce.
There is no error feedback: its residual is the quantization error of every block a rank
sends, as large as the unit's whole unsharded gradient on every rank, which is the memory
FSDP exists to save (ZeRO++ trains without it). The all-to-all waits: reductions are not
left in flight.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from .._buckets import Piece, pack_grads, unpack_reduced
from ..distributed import collectives as C
from ..distributed.axes import axis_sizes
from .quantized_gather import BlockCodec, _compute_dtype, check_block_size


@dataclass(frozen=True)
class QuantizedReduce:
    """Reduce gradients as quantized blocks through all-to-alls (ZeRO++'s qgZ): a
    :class:`~functional_fsdp.Policy` option.

    Attributes:
        block_size: elements per block, each with one float32 scale (the block's largest
            magnitude / 127, or / 7 with ``bits=4``).
        bits: 8 (int8 values: ``1 + 4 / block_size`` bytes per element sent) or 4 (two
            values per byte: ``0.5 + 4 / block_size``; ``block_size`` even).
        hierarchical: on two data axes, reduce within the minor axis first, then
            requantize and reduce over the major one (ZeRO++'s two hops); ``False``: one
            quantized hop per axis in the exact reduction's order (major axis first).

    Example:
        >>> import functional_fsdp as ff
        >>> q = ff.QuantizedReduce(block_size=128, bits=4)
        >>> ff.Policy(grad_quantization=q).grad_quantization
        QuantizedReduce(block_size=128, bits=4, hierarchical=True)
        >>> q.bytes_per_element()
        0.53125
    """

    block_size: int = 256
    bits: int = 8
    hierarchical: bool = True

    def __post_init__(self) -> None:
        check_block_size(self)
        if self.bits not in (4, 8):
            raise ValueError(
                f"QuantizedReduce(bits={self.bits!r}): 8 (int8 blocks) or 4 (two values per byte)."
            )
        if self.bits == 4 and self.block_size % 2:
            raise ValueError(
                f"QuantizedReduce(block_size={self.block_size}, bits=4): 4-bit values are "
                f"sent two per byte, so a block holds an even number of them: use "
                f"block_size={self.block_size + 1}."
            )

    def bytes_per_element(self) -> float:
        """Bytes sent per gradient element in one hop: its value plus its share of a scale."""
        return self.bits / 8 + 4 / self.block_size

    def _codec(self) -> BlockCodec:
        return BlockCodec(self.block_size, self.bits)

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
        ``numels`` elements) summed over the ranks of ``axis`` as quantized blocks: this
        rank's row of the sum, ``[total]``, in ``flat``'s dtype."""
        summed = self._hop(flat[:, None], numels, mesh, axis, counters)
        return summed[0].to(flat.dtype)

    def reduce_two_hops(
        self,
        flat: torch.Tensor,
        major: Sequence[Piece],
        minor: Sequence[Piece],
        mesh: DeviceMesh,
        axes: tuple[str, str],
        *,
        counters: C.Counters = None,
    ) -> torch.Tensor:
        """The two rounds of a reduction over ``axes`` (major, minor) in the other order.

        ``flat`` is the major round's input (``[N, total]``, :func:`pack_grads` of the
        ``major`` pieces); each row, unpacked, is what the ``minor`` round would pack into
        ``G`` rows. Summed over the minor axis first, then, requantized, over the major:
        this rank's row of the minor round's output, ``[total]`` in ``flat``'s dtype."""
        g = axis_sizes(mesh)[axes[1]]
        rows = []
        for row in flat:  # [N] x [G, total]: node i's blocks, laid out for the minor round
            blocks = dict(zip((p.index for p in major), unpack_reduced(row, major)))
            rows.append(pack_grads([blocks[p.index] for p in minor], minor, g, fused=False))
        numels = [math.prod(p.local_shape) for p in minor]
        within = self._hop(torch.stack(rows, dim=1), numels, mesh, axes[1], counters)  # [N, total]
        across = self._hop(within[:, None], numels, mesh, axes[0], counters)
        return across[0].to(flat.dtype)

    def _hop(
        self,
        x: torch.Tensor,
        numels: Sequence[int],
        mesh: DeviceMesh,
        axis: str,
        counters: C.Counters,
    ) -> torch.Tensor:
        """``x`` (``[n, m, total]``): rows ``x[k]`` quantized and sent to rank ``k`` of
        ``axis``, what arrives dequantized and summed: ``[m, total]`` in the compute dtype."""
        n, m = x.shape[0], x.shape[1]
        codec = self._codec()
        rows = x.reshape(n * m, -1)  # row (k, i) for rank k
        packed = codec.pack_rows(rows.split(list(numels), dim=1))
        size = packed.shape[1] * m
        group = mesh if len(axis_sizes(mesh)) == 1 else mesh[axis]
        got = C.raw_all_to_all(packed.view(-1), group, [size] * n, [size] * n, counters=counters)
        rows = codec.unpack(got.view(n * m, -1), numels, _compute_dtype(x.dtype))
        return rows.view(n, m, -1).sum(0)
