"""bitsandbytes 4-bit (NF4 and FP4, with or without double quantization) as a frozen format.

A ``bnb.nn.Linear4bit`` holds its weight as ``Params4bit``: ``ceil(numel / 2)`` packed bytes
plus a ``QuantState`` (one absmax per block of ``blocksize`` values: float32, or with double
quantization uint8 codes plus a nested float32 absmax per 256 blocks and one offset). Its
storage copy holds one plain uint8 tensor ``[blocks, blocksize / 2 + w]``: each row is one
block's packed bytes followed by its absmax's ``w`` bytes (4, or 1 when double-quantized).
Sharding rows over the data axes shards the blocks with their scales. With double quantization
the copy has a second frozen uint8 parameter, ``weight_nested``: the float32 offset followed by
the nested absmax (4 bytes per 256 blocks), sharded and gathered like any other. The two code
tables (16 and 256 floats, the same for every layer) stay replicated on the copy, and count
in the bytes at rest (:func:`~functional_fsdp.formats.replicated_bytes`, ``ff.plan``).

In forward, the gathered rows are split and fed to bitsandbytes' own ``gemm_4bit`` kernel (the
one ``bnb.matmul_4bit`` calls), so outputs are bitwise those of the bitsandbytes layer; the
backward dequantizes again with ``dequantize_4bit`` from the same rows (regathered by the
engine after a reshard), as bitsandbytes' ``MatMul4Bit`` does, but straight into the compute
dtype (as bitsandbytes' forward kernel does) where ``MatMul4Bit`` dequantizes in the dtype the
weight was quantized from and casts: one full weight of 2 bytes per value in a bf16 step, not
4 + 2 for a base quantized from fp32. Its CPU kernel computes each value in fp32 and rounds
once, so the gradients are bitwise bitsandbytes' (tested). Nothing is saved but the packed
rows, and the weight gets no gradient.

A layer that bitsandbytes repacked for CPU inference (its first forward in eval mode, without
gradients, on a CPU with avx512_bf16) is read back in the standard layout without changing
the user's layer; :func:`standard_layout` says what of it is exact.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn

from .._modules import shallow_copy

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
        nested: double quantization: absmax stored as uint8 codes of ``nested_code``, and
            the offset (the mean absmax of the tensor) and the nested absmax (float32, one
            per 256 blocks) in the ``weight_nested`` parameter.
        nested_code: the 8-bit code table (256 floats; ``None`` unless nested).
    """

    shape: torch.Size
    dtype: torch.dtype
    blocksize: int
    quant_type: str
    code: torch.Tensor
    nested: bool
    nested_code: torch.Tensor | None = None

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

    @property
    def nested_len(self) -> int:
        """Bytes of ``weight_nested``: the offset and one nested absmax per 256 blocks."""
        return 4 * (1 + -(self.blocks // -256)) if self.nested else 0

    def tables(self) -> tuple[torch.Tensor, ...]:
        """What every rank holds whole: the code tables (64 bytes, and 1 KiB if nested)."""
        return tuple(t for t in (self.code, self.nested_code) if t is not None)

    def split(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(packed [packed_len, 1] uint8, absmax [blocks])`` from gathered rows."""
        half = self.blocksize // 2
        packed = rows[:, :half].reshape(-1)[: self.packed_len].reshape(-1, 1)
        scales = rows[:, half:].contiguous()
        absmax = scales.reshape(-1) if self.nested else scales.view(torch.float32).reshape(-1)
        return packed, absmax

    def quant_state(
        self, absmax: torch.Tensor, nested: torch.Tensor | None, dtype: torch.dtype | None = None
    ) -> Any:
        """bitsandbytes' ``QuantState`` for this layer from gathered absmax and
        ``weight_nested`` bytes (dequantizing to ``dtype``, default :attr:`dtype`)."""
        from bitsandbytes.functional import QuantState

        state2 = offset = None
        if self.nested:
            values = nested.view(torch.float32)  # type: ignore[union-attr]
            offset = values[0]
            state2 = QuantState(
                absmax=values[1:], code=self.nested_code, blocksize=256, dtype=torch.float32
            )
        return QuantState(
            absmax=absmax,
            shape=self.shape,
            code=self.code,
            blocksize=self.blocksize,
            quant_type=self.quant_type,
            dtype=dtype or self.dtype,
            offset=offset,
            state2=state2,
        )

    def dequantize(
        self, rows: torch.Tensor, nested: torch.Tensor | None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The full weight from gathered rows, with bitsandbytes' ``dequantize_4bit``, in
        ``dtype`` (default :attr:`dtype`)."""
        import bitsandbytes.functional as F

        packed, absmax = self.split(rows)
        return F.dequantize_4bit(packed, self.quant_state(absmax, nested, dtype))


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
    return State(
        shape=torch.Size(quant_state.shape),
        dtype=quant_state.dtype,
        blocksize=int(quant_state.blocksize),
        quant_type=str(quant_state.quant_type),
        code=quant_state.code,
        nested=nested,
        nested_code=quant_state.state2.code if nested else None,
    )


def standard_layout(packed: torch.Tensor, quant_state: Any, path: str) -> tuple[torch.Tensor, Any]:
    """``(packed, QuantState)`` in bitsandbytes' standard layout, from a layer repacked for CPU
    inference (``quant_state.packing_format_for_cpu``), leaving the layer as it is.

    bitsandbytes repacks a ``Linear4bit`` in place on its first forward in eval mode without
    gradients on a CPU with avx512_bf16: the 4-bit codes are reordered into tiles, the absmax
    is transposed to ``[in / blocksize, out]`` and rounded to bfloat16, and a double-quantized
    absmax is dequantized first. The inverse, bitsandbytes' own
    ``_convert_weight_packed_for_cpu_inverse``, runs on a copy of the ``QuantState`` (it
    rebinds the state's fields).

    What is exact:

    - the packed codes: the tiling is a permutation of nibbles, undone bitwise;
    - without double quantization, the absmax: the bfloat16 values the repacked layer now
      computes with, in float32. The float32 values from before the repacking are gone: the
      layer differs from the one ``from_pretrained`` returned by that bfloat16 rounding (at
      most 2**-9 relative per block);
    - with double quantization, the absmax is quantized again to 8-bit codes with a new
      offset, as bitsandbytes does when it saves the repacked layer or moves it to a GPU:
      bitwise those bytes, but lossy twice (the bfloat16 rounding, then the 8-bit codes), so
      neither the layer before the repacking nor the values the repacked layer computes with.

    Raises:
        ValueError: naming the layer, when this bitsandbytes has no inverse.
    """
    import bitsandbytes.functional as F

    inverse = getattr(F, "_convert_weight_packed_for_cpu_inverse", None)
    if inverse is None:
        raise ValueError(
            f"{path or 'the model'} (Linear4bit, {tuple(quant_state.shape)}) was repacked by "
            f"bitsandbytes for CPU inference (its first forward ran in eval mode without "
            f"gradients on a CPU with avx512_bf16), and this bitsandbytes cannot convert it "
            f"back (no bitsandbytes.functional._convert_weight_packed_for_cpu_inverse). Put "
            f"the model in training mode (model.train()) before any forward, or load it again."
        )
    packed, state = inverse(packed.detach(), copy.copy(quant_state))
    if not state.nested:  # bitsandbytes 0.50 leaves this absmax transposed, in bfloat16
        absmax = state.absmax
        state.absmax = (absmax.T if absmax.dim() == 2 else absmax).reshape(-1).float()
    return packed, state


def nested_bytes(offset: torch.Tensor, nested_absmax: torch.Tensor) -> torch.Tensor:
    """``weight_nested``: the float32 offset and nested absmax, as uint8 bytes."""
    values = torch.cat([offset.reshape(1).float(), nested_absmax.reshape(-1).float()])
    return values.view(torch.uint8)


class _Matmul4bit(torch.autograd.Function):
    """``x @ W.T (+ bias)`` with ``W`` dequantized from gathered rows (bitsandbytes' kernels).

    Saves only the packed rows; the weight has no gradient. Works under ``torch.func``.
    """

    @staticmethod
    def forward(
        x: torch.Tensor,
        rows: torch.Tensor,
        nested: torch.Tensor | None,
        bias: torch.Tensor | None,
        state: State,
    ) -> torch.Tensor:
        packed, absmax = state.split(rows)
        op = torch.ops.bitsandbytes.gemm_4bit.default
        if state.nested:
            values = nested.view(torch.float32)  # type: ignore[union-attr]
            return op(
                x,
                packed,
                list(state.shape),
                values[1:],
                state.blocksize,
                state.quant_type,
                bias=bias,
                absmax_8bit=absmax,
                absmax_code=state.nested_code,
                absmax_offset=values[0],
            )
        return op(
            x, packed, list(state.shape), absmax, state.blocksize, state.quant_type, bias=bias
        )

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, rows, nested, bias, state = inputs
        ctx.save_for_backward(rows, nested)
        ctx.state = state
        ctx.bias_dtype = None if bias is None else bias.dtype

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        rows, nested = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:  # dequantized straight to the compute dtype: see above
            grad_x = torch.matmul(grad, ctx.state.dequantize(rows, nested, grad.dtype))
        if ctx.needs_input_grad[3]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0, dtype=ctx.bias_dtype)
        return grad_x, None, None, grad_bias, None


def _forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The storage copy's forward: ``bnb.nn.Linear4bit.forward`` on gathered rows."""
    state: State = self._ff_state  # type: ignore[assignment]
    inp_dtype = x.dtype
    compute = getattr(self, "compute_dtype", None) or x.dtype
    x = x.to(compute)
    bias = self.bias
    if bias is not None:
        bias = bias.to(compute)
    nested = self._parameters.get("weight_nested")
    return _Matmul4bit.apply(x, self.weight, nested, bias, state).to(inp_dtype)


def _zero_init(self: nn.Module) -> None:
    """A storage copy's ``reset_parameters``: zero bytes, until a checkpoint is loaded (a
    quantized base is never initialised, only loaded)."""
    with torch.no_grad():
        for p in self._parameters.values():
            if p is not None and p.dtype == torch.uint8:
                p.zero_()


_CLASSES: dict[type, type] = {}


def _stored_class(cls: type) -> type:
    """A subclass of a bitsandbytes layer class for its storage copies: ``forward`` computes
    from the packed rows, ``reset_parameters`` leaves them to a load (``ff.init_sharded``)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(
            f"Stored{cls.__name__}",
            (cls,),
            {"forward": _forward, "reset_parameters": _zero_init, "__module__": __name__},
        )
    return _CLASSES[cls]


class Bnb4:
    """The format adapter for ``bitsandbytes.nn.Linear4bit`` (see the module docstring)."""

    name = "bnb4"

    @staticmethod
    def _bnb() -> Any:
        return sys.modules.get("bitsandbytes")  # never imported for models that lack it

    def matches(self, module: nn.Module) -> bool:
        bnb = self._bnb()
        return bnb is not None and isinstance(module, bnb.nn.Linear4bit)

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

    def dense(self, module: nn.Module) -> tuple[torch.Size, torch.dtype]:
        state: State = module._ff_state  # type: ignore[assignment]
        return state.shape, state.dtype

    def saved_quantized(self, key: str, keys: Collection[str]) -> bool:
        return key + ".absmax" in keys  # bitsandbytes' serialisation: weight.absmax, ...

    def replicated(self, module: nn.Module) -> tuple[torch.Tensor, ...]:
        state: State = module._ff_state  # type: ignore[assignment]
        return state.tables()

    def storage(self, module: nn.Module, path: str = "") -> nn.Module:
        """The storage copy. A quantized layer keeps its bytes (read back in the standard
        layout if bitsandbytes repacked it for CPU inference: :func:`standard_layout`); one
        on ``meta`` (e.g. from ``replace_with_bnb_linear`` on a meta model) gets ``meta``
        rows, to be loaded shard-wise; an unquantized one with values is quantized here, as
        bitsandbytes would when moving it to a device."""
        import bitsandbytes.functional as F

        weight = module.weight
        qs = weight.quant_state
        c = shallow_copy(module, _stored_class(type(module)))
        if qs is None and weight.is_meta:
            state = State(
                shape=torch.Size(weight.shape),
                dtype=weight.dtype,
                blocksize=int(weight.blocksize),
                quant_type=str(weight.quant_type),
                code=F.get_4bit_type(weight.quant_type, device="cpu"),
                nested=bool(weight.compress_statistics),
                nested_code=F.create_dynamic_map() if weight.compress_statistics else None,
            )
            rows = torch.empty(state.row_shape, dtype=torch.uint8, device="meta")
            nested = torch.empty(state.nested_len, dtype=torch.uint8, device="meta")
        else:
            if qs is None:
                packed, qs = F.quantize_4bit(
                    weight.as_subclass(torch.Tensor).detach().contiguous(),
                    blocksize=weight.blocksize,
                    compress_statistics=weight.compress_statistics,
                    quant_type=weight.quant_type,
                )
            else:
                packed = weight.as_subclass(torch.Tensor).detach()
                if getattr(qs, "packing_format_for_cpu", False):
                    packed, qs = standard_layout(packed, qs, path)
            if packed.dtype != torch.uint8:  # bnb_4bit_quant_storage: the same bytes
                packed = packed.contiguous().view(torch.uint8)
            state = state_of(qs)
            rows = pack_rows(packed, qs.absmax, state)
            nested = nested_bytes(qs.offset, qs.state2.absmax) if state.nested else None
        c._parameters["weight"] = nn.Parameter(rows, requires_grad=False)
        if state.nested:
            c._parameters["weight_nested"] = nn.Parameter(nested, requires_grad=False)
        for p in c._parameters.values():  # never initialised by transformers' _init_weights
            if p is not None and p.dtype == torch.uint8:
                p._is_hf_initialized = True  # type: ignore[attr-defined]
        c.__dict__["_ff_format"] = self
        c.__dict__["_ff_state"] = state
        c.__dict__.pop("forward", None)  # the class's: dequantizing
        c.__dict__["_is_hf_initialized"] = True  # loaded, never initialised by transformers
        return c

    def load(
        self,
        sm: Any,
        name: str,
        module: nn.Module,
        key: str,
        keys: Collection[str],
        read: Callable[..., torch.Tensor],
        dtype: torch.dtype | None,
    ) -> dict[str, Any]:
        if name.endswith("_nested"):
            return {}  # made with the weight
        state: State = module._ff_state  # type: ignore[assignment]
        if self.saved_quantized(key, keys):
            return load_saved(sm, name, state, key, keys, read)
        want = dtype or state.dtype
        return load_layer(sm, name, state, lambda a, b: read(key, a, b).to(want))

    def dequantize(self, module: nn.Module, params: dict[str, torch.Tensor]) -> torch.Tensor:
        state: State = module._ff_state  # type: ignore[assignment]
        return state.dequantize(params["weight"], params.get("weight_nested"))


FORMAT = Bnb4()


def load_layer(
    sm: Any,
    name: str,
    state: State,
    read_rows: Callable[[int, int], torch.Tensor],
) -> dict[str, Any]:
    """Quantize one layer shard-wise: ``{name: rows, nested name: bytes}`` as ``Sharded``.

    Each rank reads (``read_rows(start, stop)``, the weight's rows in ``state.dtype``) only the
    values of the blocks it owns and quantizes them with bitsandbytes' ``quantize_4bit``:
    blocks are independent, so the packed bytes and absmax are those of the whole tensor.
    With double quantization the offset is the mean absmax over *all* blocks: the absmax
    (4 bytes per block) is all-gathered over the data axes and every rank runs bitsandbytes'
    ``quantize_blockwise`` on it, so the codes, nested absmax and offset are bitwise those of
    bitsandbytes on the whole tensor.
    """
    from ..distributed.mesh import axis_sizes
    from ..distributed.simulate import on_rank, per_coordinate
    from ..resharding import gather, shard
    from ..sharded import Sharded
    from ..spec import Layout, P

    specs, sizes = sm.param_specs(), axis_sizes(sm.mesh)
    layout = Layout.make(state.row_shape, specs[name], sizes)
    numel, width, bs = state.shape.numel(), state.shape[-1], state.blocksize
    quantize = torch.ops.bitsandbytes.quantize_4bit.default

    def blocks_of(coord: dict[str, int]) -> tuple[int, int]:
        rows = layout.owned(coord)[0][0]
        return rows.start, rows.stop

    def quantized(coord: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
        b0, b1 = blocks_of(coord)
        if b1 <= b0:
            return torch.zeros(0, 1, dtype=torch.uint8), torch.zeros(0)
        v0, v1 = b0 * bs, min(b1 * bs, numel)
        r0, r1 = v0 // width, -(v1 // -width)
        values = read_rows(r0, r1).reshape(-1)[v0 - r0 * width : v1 - r0 * width]
        return quantize(values.contiguous(), bs, state.quant_type, torch.uint8)

    def padded(t: torch.Tensor, n: int) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(n - t.shape[0], *t.shape[1:])]) if t.shape[0] < n else t

    cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def mine(coord: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
        key = blocks_of(coord)
        if key not in cache:
            cache[key] = quantized(coord)
        return cache[key]

    out: dict[str, Any] = {}
    qabsmax = None
    if state.nested:
        rows_axes = layout.spec.entry(0)
        absmax_layout = Layout.make((state.blocks,), P(rows_axes or None), sizes)
        local = per_coordinate(sm.mesh, lambda c: padded(mine(c)[1], absmax_layout.local_shape[0]))
        full = on_rank(gather(Sharded(local, (state.blocks,), absmax_layout.spec, sm.mesh)), 0)
        from bitsandbytes.functional import quantize_blockwise

        offset = full.mean()
        qabsmax, state2 = quantize_blockwise(full - offset, blocksize=256)
        nested_name = name + "_nested"
        nested = nested_bytes(offset, state2.absmax)
        out.update(shard({nested_name: nested}, sm.mesh, {nested_name: specs[nested_name]}))

    def rows_of(coord: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
        packed, absmax = mine(coord)
        if qabsmax is not None:
            b0, b1 = blocks_of(coord)
            absmax = qabsmax[b0:b1]
        return packed, absmax

    out[name] = _rows_sharded(sm, state, layout, rows_of)
    return out


def _rows_sharded(
    sm: Any,
    state: State,
    layout: Any,
    rows_of: Callable[[dict[str, int]], tuple[torch.Tensor, torch.Tensor]],
) -> Any:
    """The rows ``Sharded`` from each coordinate's ``(packed, absmax)`` of its own blocks."""
    from ..distributed.simulate import per_coordinate
    from ..sharded import Sharded

    def block(coord: dict[str, int]) -> torch.Tensor:
        slices = layout.owned(coord)[0]
        b0, b1 = slices[0].start, slices[0].stop
        out = torch.zeros(layout.local_shape, dtype=torch.uint8)
        if b1 > b0:
            packed, absmax = rows_of(coord)
            part = dataclasses.replace(state, shape=torch.Size([(b1 - b0) * state.blocksize]))
            rows = pack_rows(packed, absmax, part)[:, slices[1]]
            out[: rows.shape[0], : rows.shape[1]] = rows
        return out

    return Sharded(per_coordinate(sm.mesh, block), state.row_shape, layout.spec, sm.mesh)


def load_saved(
    sm: Any,
    name: str,
    state: State,
    key: str,
    keys: Collection[str],
    read: Callable[..., torch.Tensor],
) -> dict[str, Any]:
    """One layer of a checkpoint saved already quantized (bitsandbytes' serialisation, as
    ``save_pretrained`` of a 4-bit model writes it): each rank reads the packed bytes of its
    own blocks; the absmax (1 or 4 bytes per block) and the small state are read whole."""
    from bitsandbytes.functional import QuantState

    from ..distributed.mesh import axis_sizes
    from ..resharding import shard
    from ..spec import Layout

    prefix = key + "."
    qs = QuantState.from_dict(
        {k[len(prefix) :]: read(k) for k in keys if k.startswith(prefix)}, torch.device("cpu")
    )
    saved = state_of(qs)
    if (saved.shape, saved.blocksize, saved.quant_type, saved.nested) != (
        state.shape,
        state.blocksize,
        state.quant_type,
        state.nested,
    ):
        raise ValueError(
            f"load_safetensors: {key!r} was saved quantized as {saved.quant_type} "
            f"{tuple(saved.shape)} (blocksize {saved.blocksize}, double quantization "
            f"{saved.nested}), but the model's layer {name!r} is {state.quant_type} "
            f"{tuple(state.shape)} (blocksize {state.blocksize}, double quantization "
            f"{state.nested}). Build the model with the checkpoint's BitsAndBytesConfig."
        )
    specs = sm.param_specs()
    layout = Layout.make(state.row_shape, specs[name], axis_sizes(sm.mesh))
    half = state.blocksize // 2

    def rows_of(coord: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = layout.owned(coord)[0][0]
        stop = min(rows.stop * half, state.packed_len)
        return read(key, rows.start * half, stop), qs.absmax[rows.start : rows.stop]

    out = {name: _rows_sharded(sm, state, layout, rows_of)}
    if state.nested:
        nested_name = name + "_nested"
        nested = nested_bytes(qs.offset, qs.state2.absmax)
        out.update(shard({nested_name: nested}, sm.mesh, {nested_name: specs[nested_name]}))
    return out
