"""LoRA: low-rank adapters on a model's linear layers (Hu et al., 2021), trained while the
model's own weights stay frozen, and written as Hugging Face PEFT adapters or merged weights.

A run with a ``lora:`` section wraps each targeted ``hnn.Linear`` of the model in a
:class:`LoraLinear`: the frozen layer (``wrapped``) plus a :class:`LowRankLinear`
(``lora_A``: ``in -> r``, ``lora_B``: ``r -> out``) whose output, scaled by ``alpha / r``, is
added to the layer's::

    y = W x + b + (alpha / r) * B (A dropout(x))

``A`` starts as PEFT's does (uniform in ``+-1/sqrt(fan_in)``) and ``B`` at zero, so the model
at step 0 is exactly the base model. The surgery works on any architecture built from
``hnn.Linear`` layers, scanned ones included: a layer inside an ``hnn.Stacked`` has a
leading ``layers`` axis on its weight, and its adapters get the same axis (one adapter per
layer), so the scan slices both together.

Which layers: ``target_modules`` None adapts every linear layer but the output head (PEFT's
``all-linear``); a list adapts the layers whose name is one of its items or ends with
``.item`` (``[q_proj, v_proj]``); a string is a regular expression matched (``re.match``, as
Levanter does) against each layer's name. A layer's name is its path in the model with the
stacking left out: ``model.layers.self_attn.q_proj`` for every layer of a scanned stack
(so a pattern cannot pick single layers of a scanned stack).

Training: :func:`has_adapters` tells the trainer that only :func:`adapter_params` are
trained and hold optimizer state; the base weights stay where they are, in the model,
untouched. A checkpoint of such a run holds the adapters only, with a pointer to the base
weights (see :func:`base_pointer`), unless the base cannot be rebuilt from a source (a model
initialized at random, or one whose vocabulary was resized), in which case it holds the base
too.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Any, TypeVar

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray
from haliax.state_dict import ModuleWithStateDictSerialization
from pydantic import Field, field_validator

from levanter_core.checkpoint import read_metadata
from levanter_core.config.base import ConfigModel
from levanter_core.errors import CheckpointError, ConfigError

M = TypeVar("M")

LORA_R = "lora_r"
"""The name of the adapters' rank axis."""


class LoraConfig(ConfigModel):
    """Low-rank adapters (LoRA) on the model's linear layers: only the adapters are trained
    (Levanter's ``lora`` section, PEFT's ``LoraConfig``)."""

    r: int = Field(8, ge=1)
    """The adapters' rank."""
    alpha: float = Field(8.0, gt=0)
    """Scaling: the adapters' output is multiplied by ``alpha / r``."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input during training (PEFT's ``lora_dropout``)."""
    target_modules: list[str] | str | None = None
    """Which linear layers get adapters: None, every one but the output head (PEFT's
    ``all-linear``); a list of layer names, each matching a layer whose name is it or ends with
    ``.name`` (``[q_proj, v_proj]``); a string, a regular expression matched from the start of
    each layer's name (``.*(q_proj|v_proj)``). A layer's name is its path in the model,
    Hugging Face's names without the layer number (``model.layers.self_attn.q_proj``)."""

    @field_validator("target_modules")
    @classmethod
    def _valid_pattern(cls, value):
        if isinstance(value, str):
            try:
                re.compile(value)
            except re.error as e:
                raise ValueError(f"not a regular expression ({e}): {value!r}") from None
        if isinstance(value, list) and not value:
            raise ValueError("an empty list adapts nothing; leave it out (null) to adapt every linear layer")
        return value

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    def matches(self, name: str) -> bool:
        """Whether the linear layer called ``name`` gets adapters."""
        targets = self.target_modules
        if targets is None:
            return True
        if isinstance(targets, str):
            return re.match(targets, name) is not None
        return any(name == t or name.endswith("." + t) for t in targets)


# -- modules -----------------------------------------------------------------------------------


class LowRankLinear(eqx.Module):
    """The adapter of one linear layer: ``scale * lora_B(lora_A(dropout(x)))``."""

    lora_A: hnn.Linear
    """``in -> lora_r``."""
    lora_B: hnn.Linear
    """``lora_r -> out``."""
    scale: float = eqx.field(static=True)
    dropout: float = eqx.field(static=True, default=0.0)
    key: NamedArray | None = None
    """The dropout key of the current training step (set by :func:`with_dropout_keys`; None
    outside training, where dropout is off)."""

    def __call__(self, x: NamedArray) -> NamedArray:
        if self.dropout > 0 and self.key is not None:
            x = hnn.dropout(x, self.dropout, inference=False, key=self.key.array)
        return self.lora_B(self.lora_A(x)) * self.scale

    def delta(self) -> NamedArray:
        """The adapter as a weight update: ``scale * B @ A``, with axes ``(..., out, in)``."""
        return hax.dot(self.lora_A.weight, self.lora_B.weight, axis=LORA_R) * self.scale


class LoraLinear(ModuleWithStateDictSerialization):
    """A frozen linear layer (``wrapped``) with its adapter (``lora``). In a checkpoint's or
    Hugging Face's names the two sit at the layer's own name: ``q_proj.weight`` beside
    ``q_proj.lora_A.weight`` and ``q_proj.lora_B.weight``, as PEFT stores them."""

    wrapped: hnn.Linear
    lora: LowRankLinear

    @property
    def In(self):
        return self.wrapped.In

    @property
    def Out(self):
        return self.wrapped.Out

    def __call__(self, x: NamedArray, *, key=None) -> NamedArray:
        return self.wrapped(x) + self.lora(x)

    def merge(self) -> hnn.Linear:
        """The plain linear layer equal to this one: the adapter added to its weight."""
        weight = self.wrapped.weight
        merged = weight + self.lora.delta().rearrange(weight.axes).astype(weight.dtype)
        return eqx.tree_at(lambda m: m.weight, self.wrapped, merged)

    def _state_dict_key_map(self) -> dict[str, str | None]:
        return {"wrapped": None, "lora": None}


def _is_linear(node: Any) -> bool:
    return isinstance(node, (hnn.Linear, LoraLinear))


def _is_adapter(node: Any) -> bool:
    return isinstance(node, LowRankLinear)


def _is_lora_linear(node: Any) -> bool:
    return isinstance(node, LoraLinear)


# -- surgery -----------------------------------------------------------------------------------


def layer_name(path: tuple) -> str:
    """A layer's name from its pytree path: attribute names and list indices joined by dots,
    without what layer stacks add: ``stacked`` (``hnn.Stacked``), the ``blocks`` list of an
    ``hnn.BlockSeq`` (its index stays: it is the layer's number) and the ``groups`` of a
    ``LayerGroups`` with their index."""
    names = []
    for entry in path:
        if isinstance(entry, jax.tree_util.GetAttrKey):
            names.append(entry.name)
        elif isinstance(entry, jax.tree_util.SequenceKey):
            names.append(entry.idx)
        elif isinstance(entry, jax.tree_util.DictKey):
            names.append(str(entry.key))
    parts, i = [], 0
    while i < len(names):
        name, following = names[i], names[i + 1] if i + 1 < len(names) else None
        if name == "stacked" or (name == "blocks" and isinstance(following, int)):
            i += 1
        elif name == "groups" and isinstance(following, int):
            i += 2
        else:
            parts.append(str(name))
            i += 1
    return ".".join(parts)


def _axis_names(spec) -> set[str]:
    return {a.name for a in hax.axis_spec_to_tuple(spec)}


def stack_axes(linear: hnn.Linear) -> tuple[Axis, ...]:
    """The axes of ``linear``'s weight that are neither its inputs nor its outputs: a scanned
    stack's ``layers`` (empty outside a stack)."""
    inner = _axis_names(linear.In) | _axis_names(linear.Out)
    return tuple(a for a in linear.weight.axes if a.name not in inner)


def _is_output_head(linear: hnn.Linear) -> bool:
    return "vocab" in _axis_names(linear.Out)


def linear_layers(model: Any) -> dict[str, hnn.Linear | LoraLinear]:
    """Every linear layer of ``model`` by name (see :func:`layer_name`)."""
    found = {}
    for path, node in jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_linear)[0]:
        if _is_linear(node):
            found[layer_name(path)] = node
    return found


def target_layers(model: Any, config: LoraConfig) -> list[str]:
    """The names of the linear layers of ``model`` that ``config`` adapts. Raises
    :class:`ConfigError` when it names the output head or matches no layer at all."""
    layers = linear_layers(model)
    chosen = []
    for name, linear in layers.items():
        if not config.matches(name):
            continue
        if _is_output_head(linear):
            if config.target_modules is None:
                continue  # all-linear leaves the head alone, as PEFT does
            raise ConfigError(
                f"lora.target_modules: {name!r} is the output head; LoRA adapts the layers inside the "
                "model, not the head (leave it out)"
            )
        chosen.append(name)
    if not chosen:
        known = sorted({n.rsplit(".", 1)[-1] for n, layer in layers.items() if not _is_output_head(layer)})
        raise ConfigError(
            f"lora.target_modules: {config.target_modules!r} matches none of the model's linear layers; "
            f"their names end with: {', '.join(known)}"
        )
    return chosen


def loraize(model: M, config: LoraConfig, *, key: jax.Array) -> M:
    """``model`` with adapters on the linear layers ``config`` targets (see the module
    docstring). Adapters start with ``B = 0``: the result computes what ``model`` computes."""
    chosen = set(target_layers(model, config))
    counter = itertools.count()  # (a name can stand for several layers: those of each group of a LayerGroups)

    def wrap(path, node):
        if not isinstance(node, hnn.Linear) or layer_name(path) not in chosen:
            return node
        return _wrap(node, config, jax.random.fold_in(key, next(counter)))

    return jax.tree_util.tree_map_with_path(wrap, model, is_leaf=_is_linear)


def _wrap(linear: hnn.Linear, config: LoraConfig, key: jax.Array) -> LoraLinear:
    In, Out = hax.axis_spec_to_tuple(linear.In), hax.axis_spec_to_tuple(linear.Out)
    stacking = stack_axes(linear)  # a scanned stack's `layers`
    R = Axis(LORA_R, config.r)
    fan_in = math.prod(a.size for a in In)
    bound = 1.0 / math.sqrt(fan_in)  # PEFT's kaiming_uniform_(a=sqrt(5)) on (r, fan_in)
    dtype = linear.weight.dtype
    a = hax.random.uniform(key, (*stacking, R, *In), minval=-bound, maxval=bound).astype(dtype)
    b = hax.zeros((*stacking, *Out, R), dtype=dtype)
    adapter = LowRankLinear(
        hnn.Linear(weight=a, bias=None, In=linear.In, Out=R),
        hnn.Linear(weight=b, bias=None, In=R, Out=linear.Out),
        config.scale,
        config.dropout,
    )
    return LoraLinear(linear, adapter)


def has_adapters(model: Any) -> bool:
    """Whether ``model`` holds LoRA adapters (then only they are trained)."""
    return any(_is_lora_linear(x) for x in jax.tree.leaves(model, is_leaf=_is_lora_linear))


def adapter_params(model: M) -> M:
    """``model`` with every array but the adapters' floating-point parameters replaced by None:
    what the optimizer trains, and the part of the model a LoRA checkpoint holds."""

    return jax.tree.map(lambda node: node if _is_adapter(node) else None, model, is_leaf=_is_adapter)


def merge(model: M) -> M:
    """``model`` with every :class:`LoraLinear` replaced by the equal plain linear layer."""
    return jax.tree.map(lambda n: n.merge() if _is_lora_linear(n) else n, model, is_leaf=_is_lora_linear)


def base_model(model: M) -> M:
    """``model`` without its adapters (what it computed before training)."""
    return jax.tree.map(lambda n: n.wrapped if _is_lora_linear(n) else n, model, is_leaf=_is_lora_linear)


def with_dropout_keys(model: M, key: jax.Array) -> M:
    """``model`` with a fresh dropout key in each adapter that has dropout (one per layer of a
    stack), drawn from ``key``; adapters without dropout are returned as they are."""
    counter = itertools.count()

    def give(node):
        if not _is_adapter(node) or node.dropout == 0:
            return node
        stacking = stack_axes(node.lora_A)
        count = math.prod(a.size for a in stacking)
        keys = jax.random.split(jax.random.fold_in(key, next(counter)), max(count, 1))
        keys = jax.random.key_data(keys) if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key) else keys
        keys = keys.reshape(*(a.size for a in stacking), keys.shape[-1])
        named = hax.named(keys, (*stacking, Axis("lora_key", keys.shape[-1])))
        return eqx.tree_at(lambda n: n.key, node, named, is_leaf=lambda x: x is None)

    return jax.tree.map(give, model, is_leaf=_is_adapter)


def count_parameters(tree: Any) -> int:
    """The number of floating-point parameters in ``tree``."""
    return sum(int(x.size) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array)))


# -- checkpoints -----------------------------------------------------------------------------


def strip_base(state: Any) -> Any:
    """A :class:`~levanter_core.trainer.state.TrainerState` (or its template) with the model,
    and the averaged model if any, reduced to their adapters: what a LoRA checkpoint holds."""
    state = eqx.tree_at(lambda s: s.model, state, adapter_params(state.model), is_leaf=lambda x: x is None)
    if state.model_averaging is not None:
        averaged = adapter_params(state.model_averaging.model)
        state = eqx.tree_at(lambda s: s.model_averaging.model, state, averaged, is_leaf=lambda x: x is None)
    return state


class AdapterCheckpoints:
    """A LoRA run's view of its checkpointer: what it saves is :func:`strip_base` of the state
    (the adapters, their optimizer state, the step and key), and what it loads is put back
    onto the base weights, which ``base_state()`` (a fresh state built from the base model the
    checkpoint's metadata points to) provides. Everything else is the checkpointer's own."""

    def __init__(self, checkpointer: Any, base_state: Any, base: dict | None = None):
        """``base``: this run's ``lora_base`` pointer; a checkpoint whose adapters were trained
        on another base is refused rather than put onto this one."""
        self._inner = checkpointer
        self._base_state = base_state
        self._base = base

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def on_step(self, state: Any, step: int, *, force: bool = False) -> bool:
        return self._inner.on_step(strip_base(state), step, force=force)

    def resume(self, template: Any, where: str | None = None, *, allow_partial: bool = False):
        found = self._inner.resume(strip_base(template), where, allow_partial=allow_partial)
        if found is None:
            return None
        self._check_base(found[1])
        return self._with_base(found[0]), found[1]

    def load_state(self, template: Any, path: str, *, allow_partial: bool = False) -> Any:
        loaded = self._inner.load_state(strip_base(template), path, allow_partial=allow_partial)
        self._check_base(path)
        return self._with_base(loaded)

    def _check_base(self, path: str) -> None:
        stored = read_metadata(path).get("metadata", {}).get("lora_base")
        if self._base is not None and stored is not None and stored != self._base:
            raise CheckpointError(
                f"{path} holds LoRA adapters trained on the base {stored}, but this run's base is now "
                f"{self._base} (a newer checkpoint under trainer.initialize_from, say): the adapters would be put "
                "onto other weights. Point the run at the base they were trained on."
            )

    def _with_base(self, loaded: Any) -> Any:
        return eqx.combine(loaded, self._base_state())
