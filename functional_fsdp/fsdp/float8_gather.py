"""Fewer bytes on the wire: weights cast to float8 for the all-gather (FSDP2 + torchao's).

With ``Policy(gather_quantization=ff.Float8Gather())`` each unit's all-gather sends its
floating shards as float8 (e4m3 by default): one byte per element instead of 4 (fp32) or 2
(bf16). The scale is torchao's dynamic per-tensor scale, from the amax of the whole
parameter: at the start of each ``apply`` call every rank takes its shards' amaxes and one
small all-reduce (MAX) per mesh axis the parameters are split over gives every rank the
global ones, for all units at once, as torchao's ``precompute_float8_dynamic_scale_for_fsdp``
does. The scales are not sent with the data: every rank holds them.

The numbers are torchao's float8 cast: ``scale = float32(finfo(float8).max / max(amax, 1e-12))``
(computed in float64), ``bits = clamp(float32(x) * scale, ±finfo(float8).max).to(float8)``,
and after the gather ``bits.to(param_dtype) / scale`` for compute. So the step equals one
process computing with each parameter cast and dequantized whole (:func:`float8_round_trip`);
the shards at rest stay exact, the gradients are those of the dequantized weights, and the
backward's gather and a checkpointed unit's recompute use the forward's scales.

Only the first gather round of a parameter is cast; a second round (a dim split over two
data axes) gathers the dequantized values exactly, which changes nothing since every shard
shares the parameter's one scale.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

EPS = 1e-12  # torchao.float8.float8_utils.EPS: the smallest amax a scale is taken from
_ALIGN = 8  # bytes: each piece's segment of the packed buffer starts on this boundary
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)

ParamFilter = Callable[[str], bool] | str | Sequence[str] | None


@dataclass(frozen=True)
class Float8Gather:
    """Gather weights as float8 with a dynamic per-tensor scale (FSDP2 + torchao's float8
    all-gather): a :class:`~functional_fsdp.Policy` option.

    Attributes:
        dtype: the float8 format on the wire: ``torch.float8_e4m3fn`` (torchao's choice for
            weights) or ``torch.float8_e5m2``.
        params: which parameters are cast: ``None`` for every floating parameter (integer
            ones, such as 4-bit packed bases, are gathered as they are), fnmatch patterns
            of key paths (``"blocks.*.weight"``), or a predicate on the key path. A
            selected integer parameter is refused. torchao casts ``nn.Linear`` weights
            only; ``params="*.weight"`` with your linear layers' names does the same.

    Example:
        >>> import functional_fsdp as ff
        >>> policy = ff.Policy(gather_quantization=ff.Float8Gather(params="blocks.*"))
        >>> policy.gather_quantization.bytes_per_element()
        1
    """

    dtype: torch.dtype = torch.float8_e4m3fn
    params: ParamFilter = None

    def __post_init__(self) -> None:
        if self.dtype not in _FLOAT8:
            raise ValueError(
                f"Float8Gather(dtype={self.dtype!r}): the wire format must be a float8 type "
                f"with torchao's scaling: torch.float8_e4m3fn (the default, for weights) or "
                f"torch.float8_e5m2. For int8, use ff.QuantizedGather(block_size=...)."
            )
        p = self.params
        if isinstance(p, (list, set)):
            object.__setattr__(self, "params", tuple(p))  # hashable, like the policy
            p = self.params
        ok = p is None or isinstance(p, str) or callable(p)
        ok = ok or (isinstance(p, tuple) and all(isinstance(x, str) for x in p))
        if not ok:
            raise TypeError(
                f"Float8Gather(params={p!r}): pass None (every floating parameter), fnmatch "
                f"patterns of key paths such as 'blocks.*.weight' (a string or a tuple), or "
                f"a predicate fn(key_path) -> bool."
            )

    def bytes_per_element(self) -> int:
        """Bytes sent per gathered element (the scales are not sent: every rank has them)."""
        return 1

    def selects(self, name: str) -> bool:
        """Whether the parameter at key path ``name`` is cast (by :attr:`params`)."""
        p = self.params
        if p is None:
            return True
        if callable(p):
            return bool(p(name))
        patterns = (p,) if isinstance(p, str) else p
        return any(fnmatch.fnmatchcase(name, pat) for pat in patterns)

    def pack(
        self, shards: Sequence[torch.Tensor], scales: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor]:
        """The shards as uint8 segments for one all-gather: those with a scale cast to
        float8, the others' own bytes, each segment padded to 8 bytes."""
        out = []
        for s, scale in zip(shards, scales):
            raw = s.reshape(-1) if scale is None else to_float8(s, scale, self.dtype).reshape(-1)
            raw = raw.view(torch.uint8)
            pad = -raw.numel() % _ALIGN
            out.extend([raw, raw.new_zeros(pad)] if pad else [raw])
        return out

    def unpack(
        self,
        gathered: torch.Tensor,
        shapes: Sequence[tuple[int, torch.dtype]],
        dtype: torch.dtype,
        scales: Sequence[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        """``[n, packed bytes]`` from the all-gather back to one ``[n, numel]`` tensor in
        ``dtype`` per shard (``shapes``: each shard's numel and dtype before packing)."""
        out, offset = [], 0
        for (numel, own), scale in zip(shapes, scales):
            size = numel if scale is not None else numel * own.itemsize
            seg = gathered[:, offset : offset + size]
            if scale is None:
                out.append(seg.view(own).to(dtype))
            else:
                out.append(from_float8(seg.view(self.dtype), scale, dtype))
            offset += size + (-size % _ALIGN)
        return out


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """torchao's ``amax_to_scale``: ``float32(finfo(dtype).max / max(amax, 1e-12))``,
    divided in float64.

    Example:
        >>> import torch
        >>> amax_to_scale(torch.tensor(2.0)).item()  # e4m3's largest value is 448
        224.0
    """
    amax = amax.to(torch.float64)
    return (torch.finfo(dtype).max / torch.clamp(amax, min=EPS)).to(torch.float32)


def to_float8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchao's cast: ``clamp(float32(x) * scale, ±finfo(dtype).max)`` in ``dtype``."""
    big = torch.finfo(dtype).max
    return (x.detach().to(torch.float32) * scale).clamp(min=-big, max=big).to(dtype)


def from_float8(bits: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchao's dequantization: ``bits.to(dtype) / scale``."""
    return bits.to(dtype) / scale


def float8_round_trip(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """``x`` cast to float8 with its own dynamic scale and back to its dtype: what a
    :class:`Float8Gather` all-gather makes of a whole parameter.

    Example:
        >>> import torch
        >>> float8_round_trip(torch.tensor([1.0, -0.3, 2.0])).tolist()
        [1.0, -0.2857142984867096, 2.0]
    """
    scale = amax_to_scale(x.detach().abs().amax(), dtype)
    return from_float8(to_float8(x, scale, dtype), scale, x.dtype)


def shard_amaxes(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each shard's largest magnitude, as one float64 vector (exact for every float dtype)."""
    if not shards:
        return torch.zeros(0, dtype=torch.float64)
    return torch.stack(
        [
            s.detach().abs().amax().to(torch.float64)
            if s.numel()
            else s.new_zeros((), dtype=torch.float64)
            for s in shards
        ]
    )
