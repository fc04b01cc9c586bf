"""LoRA adapters as a Hugging Face PEFT adapter directory: ``adapter_model.safetensors``
(``base_model.model.<module>.lora_A.weight`` ``(r, in)`` and ``...lora_B.weight``
``(out, r)``, one pair per adapted module of each layer) and ``adapter_config.json``, which
``peft.PeftModel.from_pretrained(base, directory)`` loads onto the Hugging Face base model.

The module names are Hugging Face's, and only each architecture's state-dict code knows them
(a scanned stack becomes ``layers.0``, ``layers.1``...; GPT-2 keeps its projections as
``Conv1D`` with the weight transposed; some families fuse projections). Rather than
re-deriving them, :func:`adapter_names` *probes* that code: it exports a copy of the model
whose every weight is -1 except each adapted layer's, filled with a number of its own (one
per layer of a stack), and reads where each number comes out. A tensor holding one number
is that layer's weight; a tensor mixing several is a fused one, which a PEFT adapter cannot
express with separate adapters (its export is refused; the merged export works). Two more
probes fill each weight with its inputs' and its outputs' positions, which tell how the
architecture's export orders them (DeepSeek reorders rotary rows, GPT-2 transposes), so the
adapter's rows and columns are put in the same order.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, NamedTuple

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from levanter_core import lora
from levanter_core.errors import CheckpointError
from levanter_core.fileio import write_text_atomically
from levanter_core.hf.convert import to_hf_state_dict

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
"""What PEFT puts before the base model's own module names in an adapter's tensor names."""


def _is_lora_linear(node: Any) -> bool:
    return isinstance(node, lora.LoraLinear)


def _probe(model: Any, weight_of) -> dict[str, np.ndarray]:
    """The Hugging Face state dict of ``model`` with every parameter -1, except the frozen
    weight of each adapted layer, which is ``weight_of(name, linear)``."""
    background = jax.tree.map(lambda x: jnp.full_like(x, -1.0) if eqx.is_inexact_array(x) else x, model)

    def fill(path, node):
        if not _is_lora_linear(node):
            return node
        linear = node.wrapped
        weight = hax.broadcast_to(weight_of(jax.tree_util.keystr(path), linear), linear.weight.axes)
        return eqx.tree_at(lambda m: m.weight, linear, weight.astype(linear.weight.dtype))

    return to_hf_state_dict(jax.tree_util.tree_map_with_path(fill, background, is_leaf=_is_lora_linear))


def check_peft_form(model: Any) -> None:
    """Raise :class:`CheckpointError` when ``model``'s adapters have no PEFT form (a layer whose
    weight Hugging Face fuses with another's): one probe, what a run with ``peft_save_path``
    checks before it trains."""
    adapter_names(model, names_only=True)


def adapter_names(model: Any, *, names_only: bool = False) -> dict[tuple[str, int], Placement]:
    """For each adapted layer ``(its path in the model, index in its stack)``, where its weight
    sits among Hugging Face's tensors (:class:`Placement`), found by three probes: one number
    per layer (which tensor), then each weight filled with its inputs' positions, then its
    outputs' (their order and orientation there). Raises :class:`CheckpointError` for layers
    whose weight Hugging Face fuses with another's."""
    codes: dict[int, tuple[str, int]] = {}
    readable = {
        jax.tree_util.keystr(path): lora.layer_name(path)
        for path, node in jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_lora_linear)[0]
        if _is_lora_linear(node)
    }

    def numbered(name, linear):  # one number per layer of the stack
        stacking = lora.stack_axes(linear)
        count = math.prod(a.size for a in stacking)
        first = len(codes) + 1
        codes.update({first + i: (name, i) for i in range(count)})
        numbers = jnp.arange(first, first + count, dtype=jnp.float32).reshape([a.size for a in stacking])
        return hax.named(numbers, stacking)

    def positions(spec):  # each input's (or output's) position, from 1, over the flattened axes
        axes = hax.axis_spec_to_tuple(spec)
        Flat = hax.Axis("__flat__", math.prod(a.size for a in axes))
        return (hax.arange(Flat) + 1.0).unflatten_axis(Flat, axes)

    located: dict[tuple[str, int], str] = {}
    fused: set[str] = set()
    for name, tensor in _probe(model, numbered).items():
        numbers = {int(v) for v in np.unique(tensor) if v > 0}
        layers = [codes[n] for n in numbers if n in codes]
        if len(layers) == 1 and name.endswith(".weight") and tensor.ndim == 2:
            located[layers[0]] = name
        else:
            fused.update(readable[layer] for layer, _ in layers)
    if fused:
        raise CheckpointError(
            "these adapters have no PEFT form: Hugging Face stores the weights of "
            f"{', '.join(sorted(fused))} fused with other tensors, which one PEFT adapter per module cannot "
            "express; export the merged model instead (levanter export-hf without --peft; hf_save_path in a run), "
            "or leave those layers out of lora.target_modules"
        )
    if names_only:
        return {}
    ins = _probe(model, lambda name, linear: positions(linear.In))
    outs = _probe(model, lambda name, linear: positions(linear.Out))
    found = {}
    for layer, name in located.items():
        i, o = ins[name].astype(np.int64) - 1, outs[name].astype(np.int64) - 1
        if np.all(i == i[:1]):  # (out, in): every row runs over the inputs
            found[layer] = Placement(name.removesuffix(".weight"), False, o[:, 0], i[0, :])
        else:  # (in, out), Conv1D
            found[layer] = Placement(name.removesuffix(".weight"), True, o[0, :], i[:, 0])
    return found


class Placement(NamedTuple):
    """Where an adapted layer's weight sits among Hugging Face's tensors."""

    module: str
    """The Hugging Face module (``model.layers.3.self_attn.q_proj``)."""
    conv1d: bool
    """Whether the weight is stored ``(in, out)`` (GPT-2's ``Conv1D``)."""
    outputs: np.ndarray
    """For each of Hugging Face's outputs, ours (a family may reorder rows, e.g. rotary ones)."""
    inputs: np.ndarray
    """For each of Hugging Face's inputs, ours."""


def peft_tensors(model: Any) -> tuple[dict[str, np.ndarray], list[str], bool]:
    """The adapter tensors of ``model`` under PEFT's names (``lora_A`` ``(r, in)``, ``lora_B``
    ``(out, r)``), the adapted modules' names, and whether they are ``Conv1D`` modules (PEFT's
    ``fan_in_fan_out``)."""
    layers = {
        jax.tree_util.keystr(path): node
        for path, node in jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_lora_linear)[0]
        if _is_lora_linear(node)
    }
    tensors: dict[str, np.ndarray] = {}
    modules, transposed = [], set()
    for (layer, index), place in sorted(adapter_names(model).items(), key=lambda item: item[1].module):
        adapter = layers[layer].lora
        # PEFT keeps the adapter's scale out of its tensors: it multiplies by lora_alpha / r itself
        # (C order: safetensors writes the bytes as they lie, and indexing columns lays them out in F order)
        a = _per_layer(adapter.lora_A)[index][:, place.inputs]
        b = _per_layer(adapter.lora_B)[index][place.outputs, :]
        tensors[f"{PEFT_PREFIX}{place.module}.lora_A.weight"] = np.ascontiguousarray(a)
        tensors[f"{PEFT_PREFIX}{place.module}.lora_B.weight"] = np.ascontiguousarray(b)
        modules.append(place.module)
        transposed.add(place.conv1d)
    if len(transposed) > 1:
        raise CheckpointError("a PEFT adapter's modules are all Conv1D or all Linear; this model mixes them")
    return tensors, modules, transposed == {True}


def _per_layer(linear) -> np.ndarray:
    """``linear``'s weight as host floats ``(layers, out, in)`` (one layer outside a stack),
    its axes flattened as Haliax's export flattens them."""
    stacking = lora.stack_axes(linear)
    flat = linear.flatten_for_export()
    Out, In = flat.Out, flat.In
    weight = flat.weight.rearrange((*stacking, Out, In))
    array = np.asarray(jax.device_get(weight.array), dtype=np.float32)
    return array.reshape(-1, *array.shape[-2:])


def task_type_of(model_config: Any, vocab_size: int) -> str:
    """PEFT's ``task_type`` for a model of ``model_config``: ``SEQ_2_SEQ_LM`` for an
    encoder-decoder (Whisper), else ``CAUSAL_LM``; it picks the class PEFT wraps the base in."""
    try:
        hf_config = model_config.to_hf_config(vocab_size)
    except (AttributeError, ValueError):
        return "CAUSAL_LM"
    return "SEQ_2_SEQ_LM" if hf_config.get("is_encoder_decoder") else "CAUSAL_LM"


def write_peft_adapter(
    model: Any,
    config: lora.LoraConfig,
    output: str,
    *,
    base_model_name_or_path: str | None,
    task_type: str = "CAUSAL_LM",
) -> list[str]:
    """Write ``model``'s adapters (trained with ``config``) as a PEFT adapter directory
    ``output`` (local); returns the adapted modules' names. ``task_type``: PEFT's, see
    :func:`task_type_of`."""
    tensors, modules, transposed = peft_tensors(model)
    os.makedirs(output, exist_ok=True)
    save_file(tensors, os.path.join(output, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "r": config.r,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": sorted(set(modules)),
        "fan_in_fan_out": transposed,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    write_text_atomically(os.path.join(output, ADAPTER_CONFIG), json.dumps(adapter_config, indent=2) + "\n")
    return modules
