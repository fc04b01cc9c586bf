"""Feed-forward layers: the gated MLP of Llama-family models, the plain two-layer MLP, and
the activations they use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
from haliax import Axis, AxisSpec, NamedArray
from haliax.state_dict import ModuleWithStateDictSerialization, StateDict

from levanter_core.hf.layouts import fuse, unfuse

ActivationName = Literal["silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "quick_gelu"]
"""Activation names as Hugging Face configs spell them (``hidden_act``)."""

ACTIVATIONS: dict[str, Callable[[NamedArray], NamedArray]] = {
    "silu": hnn.silu,
    "gelu": lambda x: hnn.gelu(x, approximate=False),
    "gelu_new": lambda x: hnn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: hnn.gelu(x, approximate=True),
    "relu": hnn.relu,
    "quick_gelu": hnn.quick_gelu,
}


def init_linear(In: AxisSpec, Out: AxisSpec, *, key: jax.Array, std: float, use_bias: bool = False) -> hnn.Linear:
    """A Linear layer with N(0, std) weights and zero biases (the usual LLM initialization)."""
    weight = hax.random.normal(key, hax.concat_axis_specs(Out, In)) * std
    bias = hax.zeros(Out) if use_bias else None
    return hnn.Linear(weight=weight, bias=bias, In=In, Out=Out)


class GatedMlp(ModuleWithStateDictSerialization):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``: SwiGLU and GeGLU feed-forward layers,
    with Hugging Face's parameter names. ``fused`` names the tensor in which a family's
    checkpoints keep the gate and up projections together (Phi-3's ``gate_up_proj``, gate
    first); None: two tensors."""

    gate_proj: hnn.Linear
    up_proj: hnn.Linear
    down_proj: hnn.Linear
    activation: str = eqx.field(static=True)
    fused: str | None = eqx.field(static=True, default=None)

    @staticmethod
    def init(
        Embed: Axis,
        Mlp: Axis,
        activation: str,
        *,
        key: jax.Array,
        std: float = 0.02,
        down_std: float | None = None,
        use_bias: bool = False,
        fused: str | None = None,
    ) -> GatedMlp:
        """``down_std`` (default ``std``) lets a model scale down the projection into the residual stream."""
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; known: {sorted(ACTIVATIONS)}")
        k_gate, k_up, k_down = jax.random.split(key, 3)
        return GatedMlp(
            init_linear(Embed, Mlp, key=k_gate, std=std, use_bias=use_bias),
            init_linear(Embed, Mlp, key=k_up, std=std, use_bias=use_bias),
            init_linear(Mlp, Embed, key=k_down, std=std if down_std is None else down_std, use_bias=use_bias),
            activation,
            fused,
        )

    def __call__(self, x: NamedArray) -> NamedArray:
        return self.down_proj(ACTIVATIONS[self.activation](self.gate_proj(x)) * self.up_proj(x))

    def to_state_dict(self, prefix: str | None = None) -> StateDict:
        state = super().to_state_dict(prefix)
        return state if self.fused is None else fuse(state, prefix, ("gate_proj", "up_proj"), self.fused)

    def from_state_dict(self, state_dict: StateDict, prefix: str | None = None) -> GatedMlp:
        if self.fused is not None:
            rows = self.gate_proj.Out.size
            state_dict = unfuse(state_dict, prefix, (("gate_proj", rows), ("up_proj", rows)), self.fused)
        loaded: GatedMlp = super().from_state_dict(state_dict, prefix)
        return loaded


class Mlp(eqx.Module):
    """``down_proj(act(up_proj(x)))``: the plain two-layer feed-forward layer (no gate)."""

    up_proj: hnn.Linear
    down_proj: hnn.Linear
    activation: str = eqx.field(static=True)

    @staticmethod
    def init(
        Embed: Axis,
        Hidden: Axis,
        activation: str,
        *,
        key: jax.Array,
        std: float = 0.02,
        down_std: float | None = None,
        use_bias: bool = False,
    ) -> Mlp:
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; known: {sorted(ACTIVATIONS)}")
        k_up, k_down = jax.random.split(key, 2)
        return Mlp(
            init_linear(Embed, Hidden, key=k_up, std=std, use_bias=use_bias),
            init_linear(Hidden, Embed, key=k_down, std=std if down_std is None else down_std, use_bias=use_bias),
            activation,
        )

    def __call__(self, x: NamedArray) -> NamedArray:
        return self.down_proj(ACTIVATIONS[self.activation](self.up_proj(x)))
