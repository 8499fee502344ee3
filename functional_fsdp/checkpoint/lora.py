"""Export LoRA adapters in peft's format, and the merged model, from sharded parameters.

``sm.module`` is a ``peft.PeftModel``. :func:`export_peft_adapter` gathers only the adapter's
parameters (peft's own ``get_peft_model_state_dict`` chooses them) and writes
``adapter_model.safetensors`` and ``adapter_config.json`` as ``PeftModel.save_pretrained``
does, so ``PeftModel.from_pretrained(base, path)`` loads them. :func:`export_merged` writes the
base model with every LoRA layer merged (``W + scaling * B @ A``), streamed one unit at a time
like :func:`~functional_fsdp.checkpoint.export_safetensors`.

Example:
    >>> ff.checkpoint.export_peft_adapter(sm, params, "adapter")  # doctest: +SKIP
    >>> ff.checkpoint.export_merged(sm, params, "merged")  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import functools
import operator
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..formats import stored_param
from ..resharding import gather
from ..sharded import Sharded
from ._common import (
    check_params,
    first_value,
    is_writer,
    persistent_buffers,
    unit_of,
    write_atomic,
)
from .hf_export import OutTensor, _agree, _cast, write_configs, write_streamed

_PREFIX = "base_model.model."


def _peft_model(what: str, sm: Any, adapter_name: str) -> Any:
    module = sm.module
    configs = getattr(module, "peft_config", None)
    if not isinstance(configs, dict) or not hasattr(module, "get_base_model"):
        raise TypeError(
            f"{what}: sm.module is a {type(module).__name__}, not a peft PeftModel. Wrap the "
            f"model first (model = peft.get_peft_model(model, LoraConfig(...))) and build sm "
            f"from it."
        )
    if adapter_name not in configs:
        raise ValueError(
            f"{what}: the model has no adapter {adapter_name!r}; its adapters are "
            f"{sorted(configs)}. Pass adapter_name= one of them."
        )
    return module


def _selected(module: Any, adapter_name: str) -> dict[str, str]:
    """``{key in the adapter file: key in the module's state dict}``, as peft selects them.

    peft's ``get_peft_model_state_dict`` runs on a state dict of meta tensors, so its own
    rules (adapter name, modules_to_save, embedding layers) decide without any data.
    """
    from peft import get_peft_model_state_dict

    meta = {
        k: torch.empty(v.shape, dtype=v.dtype, device="meta")
        for k, v in module.state_dict(keep_vars=True).items()
    }
    by_id = {id(v): k for k, v in meta.items()}
    chosen = get_peft_model_state_dict(module, state_dict=meta, adapter_name=adapter_name)
    out = {}
    for key, value in chosen.items():
        if id(value) not in by_id:
            raise ValueError(
                f"export_peft_adapter: peft computes {key!r} from the model rather than "
                f"selecting it; save this adapter with PeftModel.save_pretrained on one process."
            )
        out[key] = by_id[id(value)]
    return out


def export_peft_adapter(
    sm: Any,
    params: Mapping[str, Sharded],
    path: str | os.PathLike[str],
    *,
    adapter_name: str = "default",
) -> None:
    """Write the LoRA adapter of ``sm.module`` (a ``PeftModel``) as peft's ``save_pretrained``.

    Only the adapter's parameters are gathered; the base model's shards stay where they are.
    Files: ``adapter_model.safetensors`` (peft's key names, without the adapter name) and
    ``adapter_config.json``, under ``path`` (or ``path/adapter_name`` for another adapter than
    ``"default"``, as peft does). A collective call: every rank calls it, the first rank of
    the mesh writes.

    Raises:
        TypeError: ``sm.module`` is not a ``PeftModel``.
        ValueError: no such adapter, or ``params`` do not match the model (the key is named).

    Example:
        >>> ff.checkpoint.export_peft_adapter(sm, params, "adapter")  # doctest: +SKIP
        >>> PeftModel.from_pretrained(base_model, "adapter")  # doctest: +SKIP
    """
    from safetensors.torch import save_file

    what = "export_peft_adapter"
    module = _peft_model(what, sm, adapter_name)
    names = check_params(what, sm, params)
    first = {a: ns[0] for ns in names.values() for a in ns}
    selected = _selected(module, adapter_name)
    not_params = [k for k in selected.values() if k not in first]
    if not_params:
        raise ValueError(
            f"{what}: the adapter holds {not_params[:3]}, which are buffers, not parameters; "
            f"save it with PeftModel.save_pretrained on one process."
        )
    needed = sorted({first[k] for k in selected.values()})
    gathered = gather({k: params[k] for k in needed})
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, source in selected.items():
        t = first_value(gathered[first[source]]).detach().contiguous()
        tensors[key] = t.clone() if id(t) in seen else t  # safetensors refuses aliases
        seen.add(id(t))
    out_dir = os.fspath(path)
    if adapter_name != "default":
        out_dir = os.path.join(out_dir, adapter_name)
    writer = is_writer(sm.mesh)
    error: BaseException | None = None
    if writer:
        try:
            os.makedirs(out_dir, exist_ok=True)
            write_atomic(
                os.path.join(out_dir, "adapter_model.safetensors"),
                lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}),
            )
            _write_adapter_config(module, adapter_name, out_dir)
        except Exception as e:
            error = e
    if _agree(sm.mesh, error is not None):
        if error is not None:
            raise error
        raise RuntimeError(f"{what}: writing {out_dir!r} failed on the writing rank.")


def _write_adapter_config(module: Any, adapter_name: str, out_dir: str) -> None:
    """``adapter_config.json`` exactly as ``PeftModel.save_pretrained`` writes it."""
    config = copy.deepcopy(module.peft_config[adapter_name])  # never change the user's
    if config.base_model_name_or_path is None:
        source = module.base_model if config.is_prompt_learning else module.base_model.model
        config.base_model_name_or_path = source.__dict__.get("name_or_path", None) or None
    config.inference_mode = True
    auto_mapping = None
    if config.task_type is None:
        base_class = module._get_base_model_class(is_prompt_tuning=config.is_prompt_learning)
        auto_mapping = {
            "base_model_class": base_class.__name__,
            "parent_library": base_class.__module__,
        }
    tmp = tempfile.mkdtemp(dir=out_dir, prefix=".adapter_config.tmp-")
    try:
        config.save_pretrained(tmp, auto_mapping_dict=auto_mapping)
        os.replace(
            os.path.join(tmp, "adapter_config.json"), os.path.join(out_dir, "adapter_config.json")
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _base_name(key: str, adapter_name: str) -> str | None:
    """The base model's name for a ``PeftModel`` state-dict key (``None``: not in it)."""
    parts = key.removeprefix(_PREFIX).split(".")
    if any(p.startswith("lora_") for p in parts) or "original_module" in parts:
        return None
    out: list[str] = []
    i = 0
    while i < len(parts):
        if parts[i] == "base_layer":
            i += 1
        elif parts[i] == "modules_to_save":
            if i + 1 < len(parts) and parts[i + 1] != adapter_name:
                return None
            i += 2
        else:
            out.append(parts[i])
            i += 1
    return ".".join(out)


def _merges(what: str, module: Any, adapter_name: str) -> dict[str, tuple[str, str, float, bool]]:
    """``{base weight name: (A name, B name, scaling, transpose)}`` for every LoRA layer."""
    from peft.tuners import lora

    out = {}
    for path, layer in module.named_modules():
        if not isinstance(layer, lora.LoraLayer):
            continue
        if adapter_name not in layer.lora_A and adapter_name not in layer.lora_embedding_A:
            continue
        if adapter_name in getattr(layer, "lora_variant", {}) or layer.lora_bias.get(
            adapter_name, False
        ):
            raise ValueError(
                f"{what}: {path!r} uses a LoRA variant (DoRA or lora_bias) for adapter "
                f"{adapter_name!r}; export_merged merges plain LoRA only. Export the adapter "
                f"with export_peft_adapter and merge it with peft's merge_and_unload()."
            )
        scaling = float(layer.scaling[adapter_name])
        bnb4 = getattr(getattr(lora, "bnb", None), "Linear4bit", None)  # peft's, over 4-bit
        if type(layer) is lora.Linear or (bnb4 is not None and type(layer) is bnb4):
            a, b = f"{path}.lora_A.{adapter_name}.weight", f"{path}.lora_B.{adapter_name}.weight"
            out[f"{path}.base_layer.weight"] = (a, b, scaling, bool(layer.fan_in_fan_out))
        elif type(layer) is lora.Embedding:
            a, b = (
                f"{path}.lora_embedding_A.{adapter_name}",
                f"{path}.lora_embedding_B.{adapter_name}",
            )
            out[f"{path}.base_layer.weight"] = (a, b, scaling, True)
        else:
            raise ValueError(
                f"{what}: {path!r} is a peft {type(layer).__name__} LoRA layer; export_merged "
                f"merges LoRA on Linear and Embedding layers. Export the adapter with "
                f"export_peft_adapter and merge it with peft's merge_and_unload()."
            )
    return out


def _merged(
    weight_of: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    a: str,
    b: str,
    scaling: float,
    transpose: bool,
) -> Callable[..., Any]:
    def make(g: dict[str, torch.Tensor]) -> torch.Tensor:
        weight, lora_a, lora_b = weight_of(g), g[a], g[b]
        if weight.dtype in (torch.float16, torch.bfloat16) and weight.device.type == "cpu":
            lora_a, lora_b = lora_a.float(), lora_b.float()  # as peft merges on the CPU
        delta = lora_b @ lora_a
        delta = (delta.T if transpose else delta) * scaling
        return weight + delta.to(weight.dtype)

    return make


def export_merged(
    sm: Any,
    params: Mapping[str, Sharded],
    path: str | os.PathLike[str],
    *,
    adapter_name: str = "default",
    dtype: torch.dtype | None = None,
    config: Any = None,
    max_shard_size: int | str = "50GB",
) -> None:
    """Write the base model with the LoRA adapter merged in, one unit at a time.

    Each LoRA layer's base weight becomes ``W + scaling * B @ A`` (transposed for
    ``fan_in_fan_out`` and embeddings), as peft's ``merge_and_unload()`` computes it, and
    every name loses peft's wrapping (``base_model.model.``, ``.base_layer``,
    ``modules_to_save.<adapter>``), so the directory loads with the base class's
    ``from_pretrained``. Layout, tied weights, atomic writes and memory are as in
    :func:`~functional_fsdp.checkpoint.export_safetensors`; ``config.json`` is the base
    model's. A collective call.

    Raises:
        TypeError: ``sm.module`` is not a ``PeftModel``.
        ValueError: no such adapter, a LoRA variant or layer type it does not merge (DoRA,
            lora_bias, convolutions), or ``params`` that do not match the model.

    Example:
        >>> ff.checkpoint.export_merged(sm, params, "merged")  # doctest: +SKIP
        >>> LlamaForCausalLM.from_pretrained("merged")  # doctest: +SKIP
    """
    what = "export_merged"
    module = _peft_model(what, sm, adapter_name)
    names = check_params(what, sm, params)
    first = {a: ns[0] for ns in names.values() for a in ns}
    merges = _merges(what, module, adapter_name)
    kept = persistent_buffers(module)
    outs = []
    for key, value in module.state_dict(keep_vars=True).items():
        name = _base_name(key, adapter_name)
        if name is None:
            continue
        if key in first:
            if first[key] != key:
                continue  # a tied name: written once, as save_pretrained does
            p = params[key]
            shape, out_dtype = p.global_shape, _cast(p.local, dtype)
            needs: tuple[str, ...] = (key,)
            make: Callable[..., Any] = operator.itemgetter(key)
            found = stored_param(sm.module, key)
            if found is not None:  # a quantized base: written dequantized (formats/)
                if not found.is_weight:
                    continue  # its quantization state: part of the weight's dequantization
                full_shape, full_dtype = found.format.dense(found.layer)
                shape, out_dtype = tuple(full_shape), dtype or full_dtype
                needs = tuple(k for k in found.names(key) if k in params)
                make = functools.partial(found.dequantize, key)
            if key in merges:
                a, b, scaling, transpose = merges[key]
                weight_of = make
                needs = (*needs, first[a], first[b])
                make = _merged(weight_of, first[a], first[b], scaling, transpose)
            outs.append(OutTensor(name, shape, out_dtype, unit_of(key, sm.units), needs, make))
        elif key in kept:
            outs.append(
                OutTensor(
                    name, tuple(value.shape), _cast(value, dtype), "", (), lambda g, t=value: t
                )
            )
    base = module.get_base_model()
    write_streamed(
        sm,
        params,
        outs,
        os.fspath(path),
        max_shard_size=max_shard_size,
        what=what,
        extra=lambda p: write_configs(base, p, config, dtype),
    )
