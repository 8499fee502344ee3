"""bitsandbytes 4-bit (NF4 and FP4, with or without double quantization) as a frozen format.

A ``bnb.nn.Linear4bit`` holds its weight as ``Params4bit``: ``ceil(numel / 2)`` packed bytes
plus a ``QuantState`` (one absmax per block of ``blocksize`` values: float32, or with double
quantization uint8 codes plus a nested float32 absmax per 256 blocks and one offset). Its
storage copy holds one plain uint8 tensor ``[blocks, blocksize / 2 + w]``: each row is one
block's packed bytes followed by its absmax's ``w`` bytes (4, or 1 when double-quantized).
Sharding rows over the data axes shards the blocks with their scales; the nested absmax, the
code tables and the offset (a few bytes per 16384 values) stay replicated on the copy.

In forward, the gathered rows are split and fed to bitsandbytes' own ``gemm_4bit`` kernel (the
one ``bnb.matmul_4bit`` calls), so outputs are bitwise those of the bitsandbytes layer; the
backward dequantizes again with ``dequantize_4bit`` from the same rows (regathered by the
engine after a reshard), as bitsandbytes' ``MatMul4Bit`` does. Nothing is saved but the
packed rows, and the weight gets no gradient.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any

import torch
from torch import nn

from . import shallow_copy

HELP_8BIT = (
    "4-bit bases are supported (BitsAndBytesConfig(load_in_4bit=True, ...), NF4 or FP4, with "
    "or without bnb_4bit_use_double_quant); load the model with load_in_4bit=True instead of "
    "load_in_8bit=True, or unquantized."
)


@dataclasses.dataclass(frozen=True, eq=False)
class State:
    """The replicated, static part of one layer's quantization state.

    Attributes:
        shape: the weight's shape ``[out, in]``.
        dtype: the dtype it was quantized from (what ``dequantize`` returns).
        blocksize: values per block (one absmax each).
        quant_type: ``"nf4"`` or ``"fp4"``.
        code: the 4-bit code table (16 floats).
        nested: double quantization: absmax stored as uint8 codes of ``nested_code``.
        nested_absmax: float32, one per 256 blocks (``None`` unless nested).
        nested_code: the 8-bit code table (256 floats; ``None`` unless nested).
        offset: the mean absmax subtracted before double quantization (scalar; ``None``
            unless nested).
    """

    shape: torch.Size
    dtype: torch.dtype
    blocksize: int
    quant_type: str
    code: torch.Tensor
    nested: bool
    nested_absmax: torch.Tensor | None = None
    nested_code: torch.Tensor | None = None
    offset: torch.Tensor | None = None

    @property
    def packed_len(self) -> int:
        """Bytes of packed values: two 4-bit values per byte."""
        return (self.shape.numel() + 1) // 2

    @property
    def blocks(self) -> int:
        return -(self.shape.numel() // -self.blocksize)

    @property
    def scale_width(self) -> int:
        """Bytes of one block's absmax in a row."""
        return 1 if self.nested else 4

    @property
    def row_shape(self) -> tuple[int, int]:
        return self.blocks, self.blocksize // 2 + self.scale_width

    def replicated_bytes(self) -> int:
        """Bytes held whole on every rank (code tables, nested absmax, offset)."""
        parts = [self.code, self.nested_absmax, self.nested_code, self.offset]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def split(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(packed [packed_len, 1] uint8, absmax [blocks])`` from gathered rows."""
        half = self.blocksize // 2
        packed = rows[:, :half].reshape(-1)[: self.packed_len].reshape(-1, 1)
        scales = rows[:, half:].contiguous()
        absmax = scales.reshape(-1) if self.nested else scales.view(torch.float32).reshape(-1)
        return packed, absmax

    def quant_state(self, absmax: torch.Tensor) -> Any:
        """bitsandbytes' ``QuantState`` for this layer with the given (gathered) absmax."""
        from bitsandbytes.functional import QuantState

        state2 = None
        if self.nested:
            state2 = QuantState(
                absmax=self.nested_absmax, code=self.nested_code, blocksize=256, dtype=torch.float32
            )
        return QuantState(
            absmax=absmax,
            shape=self.shape,
            code=self.code,
            blocksize=self.blocksize,
            quant_type=self.quant_type,
            dtype=self.dtype,
            offset=self.offset,
            state2=state2,
        )

    def dequantize(self, rows: torch.Tensor) -> torch.Tensor:
        """The full weight from gathered rows, with bitsandbytes' ``dequantize_4bit``."""
        import bitsandbytes.functional as F

        packed, absmax = self.split(rows)
        return F.dequantize_4bit(packed, self.quant_state(absmax))


def pack_rows(packed: torch.Tensor, absmax: torch.Tensor, state: State) -> torch.Tensor:
    """Rows ``[blocks, blocksize / 2 + w]`` from packed bytes and per-block absmax.

    Example:
        >>> s = State(shape=torch.Size([2, 64]), dtype=torch.float32, blocksize=64,
        ...           quant_type="nf4", code=torch.zeros(16), nested=False)
        >>> pack_rows(torch.zeros(64, 1, dtype=torch.uint8), torch.ones(2), s).shape
        torch.Size([2, 36])
    """
    half = state.blocksize // 2
    flat = packed.reshape(-1)
    if flat.numel() < state.blocks * half:
        flat = torch.cat([flat, flat.new_zeros(state.blocks * half - flat.numel())])
    scales = absmax.reshape(-1).contiguous()
    scales = scales.view(torch.uint8).reshape(state.blocks, state.scale_width)
    return torch.cat([flat.reshape(state.blocks, half), scales], dim=1)


def state_of(quant_state: Any) -> State:
    """The static :class:`State` of a bitsandbytes ``QuantState``."""
    nested = bool(getattr(quant_state, "nested", False))
    s2 = quant_state.state2 if nested else None
    return State(
        shape=torch.Size(quant_state.shape),
        dtype=quant_state.dtype,
        blocksize=int(quant_state.blocksize),
        quant_type=str(quant_state.quant_type),
        code=quant_state.code,
        nested=nested,
        nested_absmax=None if s2 is None else s2.absmax,
        nested_code=None if s2 is None else s2.code,
        offset=quant_state.offset if nested else None,
    )


class _Matmul4bit(torch.autograd.Function):
    """``x @ W.T (+ bias)`` with ``W`` dequantized from gathered rows (bitsandbytes' kernels).

    Saves only the packed rows; the weight has no gradient. Works under ``torch.func``.
    """

    @staticmethod
    def forward(
        x: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None, state: State
    ) -> torch.Tensor:
        packed, absmax = state.split(rows)
        op = torch.ops.bitsandbytes.gemm_4bit.default
        if state.nested:
            return op(
                x,
                packed,
                list(state.shape),
                state.nested_absmax,
                state.blocksize,
                state.quant_type,
                bias=bias,
                absmax_8bit=absmax,
                absmax_code=state.nested_code,
                absmax_offset=state.offset,
            )
        return op(
            x, packed, list(state.shape), absmax, state.blocksize, state.quant_type, bias=bias
        )

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, rows, bias, state = inputs
        ctx.save_for_backward(rows)
        ctx.state = state
        ctx.bias_dtype = None if bias is None else bias.dtype

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (rows,) = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.matmul(grad, ctx.state.dequantize(rows).to(grad.dtype))
        if ctx.needs_input_grad[2]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0, dtype=ctx.bias_dtype)
        return grad_x, None, grad_bias, None


def _forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The storage copy's forward: ``bnb.nn.Linear4bit.forward`` on gathered rows."""
    state: State = self._ff_state  # type: ignore[assignment]
    inp_dtype = x.dtype
    compute = getattr(self, "compute_dtype", None) or x.dtype
    x = x.to(compute)
    bias = self.bias
    if bias is not None:
        bias = bias.to(compute)
    return _Matmul4bit.apply(x, self.weight, bias, state).to(inp_dtype)


class Bnb4:
    """The format adapter for ``bitsandbytes.nn.Linear4bit`` (see the module docstring)."""

    name = "bnb4"

    @staticmethod
    def _bnb() -> Any:
        return sys.modules.get("bitsandbytes")  # never imported for models that lack it

    def matches(self, module: nn.Module) -> bool:
        bnb = self._bnb()
        if bnb is None or not isinstance(module, bnb.nn.Linear4bit):
            return False
        return getattr(module.weight, "quant_state", None) is not None

    def refuse(self, module: nn.Module, path: str) -> None:
        bnb = self._bnb()
        if bnb is None:
            return
        if isinstance(module, bnb.nn.Linear8bitLt):
            raise ValueError(
                f"{path or 'the model'} ({type(module).__name__}, weight "
                f"{tuple(module.weight.shape)} {module.weight.dtype}) is an 8-bit bitsandbytes "
                f"layer, which functional_fsdp cannot shard: {HELP_8BIT}"
            )
        if isinstance(module, bnb.nn.Linear4bit) and module.weight.quant_state is None:
            raise ValueError(
                f"{path or 'the model'} (bnb.nn.Linear4bit, weight "
                f"{tuple(module.weight.shape)}) is not quantized yet (its Params4bit has no "
                f"quant_state). Load the model with from_pretrained(..., "
                f"quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...), "
                f"device_map='cpu') or move it to its device first."
            )

    def storage(self, module: nn.Module) -> nn.Module:
        weight = module.weight
        state = state_of(weight.quant_state)
        packed = weight.as_subclass(torch.Tensor).detach()
        rows = pack_rows(packed, weight.quant_state.absmax, state)
        c = shallow_copy(module)
        c._parameters["weight"] = nn.Parameter(rows, requires_grad=False)
        c.__dict__["_ff_format"] = self
        c.__dict__["_ff_state"] = state
        c.__dict__["forward"] = types.MethodType(_forward, c)
        return c

    def dequantize(self, module: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        return module._ff_state.dequantize(rows)  # type: ignore[union-attr,operator]


FORMAT = Bnb4()
