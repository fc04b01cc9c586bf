"""The Trainer's state: a fresh one at step 0 (around new or existing weights, created with the
parameter sharding), its shapes and shardings without computing it, the check that the axis
mappings fit it, and the model of a state to evaluate."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray

from levanter_core import lora
from levanter_core.trainer.base import TrainerBase
from levanter_core.trainer.sharding_checks import check_axis_names, check_divisible
from levanter_core.trainer.state import TrainerState
from levanter_core.trainer.trainable import is_quantized, trainable


class StateInit(TrainerBase):
    """The state-making part of the Trainer."""

    frozen_aside: bool = False
    """Whether the objective keeps a frozen model of its own (:meth:`load_frozen`): states are
    then made, saved and loaded without it, and :meth:`with_frozen` puts it in."""

    def load_frozen(self, Vocab) -> Any | None:
        """The objective's own frozen model (:meth:`~levanter_core.objective.Objective.frozen_model`)
        for a trained model of vocabulary ``Vocab``, cast to the compute precision and placed with
        the parameter sharding; None when it keeps none."""
        frozen = self.objective.frozen_model(Vocab)
        if frozen is None:
            return None
        if not self.objective.keeps_reference:
            raise TypeError(
                f"{type(self.objective).__name__}.frozen_model returns a model, so it must set keeps_reference"
            )
        self.frozen_aside = True
        with hax.partitioning.set_mesh(self.mesh):
            return hax.named_jit(self.mp.cast_to_compute, axis_resources=self.parameter_mapping)(frozen)

    def with_frozen(self, state: TrainerState, frozen) -> TrainerState:
        """``state`` (made or loaded without it) holding the objective's frozen model as its reference."""
        return dataclasses.replace(state, reference=frozen)

    def _fresh_state(self, model, training_key: jax.Array) -> TrainerState:
        """Step 0 around ``model``: parameter precision, a fresh optimizer state, and an
        average that starts at the model when averaging is on."""
        model = self.quantize(self.mp.cast_to_param(model))
        averaging = self.config.model_averaging
        reference = None
        if self.objective.keeps_reference and not self.frozen_aside and not lora.has_adapters(model):
            reference = jax.tree.map(jnp.copy, eqx.filter(model, eqx.is_array))  # buffers of its own
            reference = eqx.combine(reference, model)
        return TrainerState(
            jnp.zeros((), jnp.int32),
            model,
            self.optimizer.init(trainable(model)),
            training_key,
            averaging.create(model) if averaging is not None else None,
            reference,
        )

    def _initializer(self, model_init: Callable[[jax.Array], Any], key: jax.Array) -> Callable[[], TrainerState]:
        model_key, training_key = jax.random.split(key)
        return lambda: self._fresh_state(model_init(model_key), training_key)

    def init_state(self, model_init: Callable[[jax.Array], Any], key: jax.Array) -> TrainerState:
        """A fresh state, created directly with the parameter sharding."""
        with hax.partitioning.set_mesh(self.mesh):
            return hax.named_jit(self._initializer(model_init, key), axis_resources=self.parameter_mapping)()

    def state_from_model(self, model, key: jax.Array) -> TrainerState:
        """A state at step 0 around existing weights (an import or ``initialize_from``),
        with a fresh optimizer state; ``key`` is used as by :meth:`init_state`."""
        _, training_key = jax.random.split(key)
        with hax.partitioning.set_mesh(self.mesh):
            return hax.named_jit(self._fresh_state, axis_resources=self.parameter_mapping)(model, training_key)

    def quantize(self, model):
        """``model`` with its linear layers quantized as ``trainer.quantization`` says (a model
        quantized already, or no quantization: unchanged)."""
        if self.quantization is None or is_quantized(model):
            return model
        return hax.quantization.quantize_linear_layers(model, self.quantization)

    def eval_model(self, state: TrainerState):
        """The model to evaluate (and export): the averaged model when
        ``trainer.model_averaging`` is on, else the trained one."""
        if state.model_averaging is not None:
            return state.model_averaging.model
        if self.eval_params is None:
            return state.model
        with hax.partitioning.set_mesh(self.mesh):
            return eqx.combine(self.eval_params(trainable(state.model), state.opt_state), state.model)

    def state_template(self, model_init: Callable[[jax.Array], Any], key: jax.Array) -> TrainerState:
        """Shapes, dtypes and shardings of :meth:`init_state`'s result, without computing it."""
        shapes = eqx.filter_eval_shape(self._initializer(model_init, key))
        with hax.partitioning.set_mesh(self.mesh):
            shardings = hax.partitioning.infer_resource_partitions(shapes, self.parameter_mapping)

        def with_sharding(shape, sharding):
            if isinstance(shape, NamedArray):  # infer_resource_partitions gives one sharding per NamedArray
                if shape.array is None:  # a parameter the optimizer does not train (LoRA's frozen base)
                    return shape
                return NamedArray(
                    jax.ShapeDtypeStruct(shape.array.shape, shape.array.dtype, sharding=sharding), shape.axes
                )
            return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding)

        return jax.tree.map(
            with_sharding, shapes, shardings, is_leaf=lambda x: isinstance(x, (NamedArray, jax.ShapeDtypeStruct))
        )

    def check_sharding(self, model_init: Callable[[jax.Array], Any], key: jax.Array) -> None:
        """Raise a :class:`ConfigError` naming the config field, before anything is compiled,
        when the axis mappings do not fit the model: a logical axis that no array of the model
        has (likely a typo), or a parameter axis whose size the mesh axes it is split over do not
        divide (JAX refuses to store an unevenly split array; haliax does not pad or replicate it).
        Only shapes are computed (``eqx.filter_eval_shape``)."""
        state = eqx.filter_eval_shape(self._initializer(model_init, key))
        arrays = [
            (jax.tree_util.keystr(path).lstrip("."), leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, NamedArray))[
                0
            ]
            if isinstance(leaf, NamedArray)
        ]
        parameter_axes = {axis.name for _, array in arrays for axis in array.axes}
        check_axis_names(self.config, parameter_axes)
        for path, array in arrays:
            check_divisible(self.config, self.parameter_mapping, self.mesh, path, array)
