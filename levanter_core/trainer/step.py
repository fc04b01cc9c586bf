"""The Trainer's compiled training step: the loss in the compute precision, its gradient averaged
over the microbatches (gradient accumulation), the optimizer's update (which receives the loss,
the step's objective, a key and the step), the averaged model, and the step compiled once per
state structure with the state donated."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import optax
from haliax import Axis, NamedArray
from jax.sharding import NamedSharding, PartitionSpec

from levanter_core import lora
from levanter_core.errors import ConfigError
from levanter_core.layers.parallel import parallel_settings
from levanter_core.optim.skipstep import skipped_step
from levanter_core.optim.step import BatchObjective
from levanter_core.tracker.jit_log import collecting
from levanter_core.trainer.placement import BatchPlacement
from levanter_core.trainer.state import TrainerState
from levanter_core.trainer.trainable import trainable
from levanter_core.trainer.watch import watch_stats

_OPTIMIZER_STREAM = 0x0971
"""Folded into the state's training key for the optimizer's key of each step (``key=``), so it is
independent of the keys the loss and the next step get from splitting the training key."""
_LORA_DROPOUT_STREAM = 0x10A4
"""Folded into a (micro)batch's loss key for the LoRA adapters' dropout keys."""


def _batch_axis(example, name: str) -> Axis:
    """The batch axis (called ``name``) of an example: that of its first named array."""
    for leaf in jax.tree.leaves(example, is_leaf=lambda x: isinstance(x, NamedArray)):
        if isinstance(leaf, NamedArray):
            return leaf.resolve_axis(name)
    raise ValueError("the example holds no named array")


class TrainStep(BatchPlacement):
    """The training-step part of the Trainer."""

    _flat_steps: list[tuple[Any, jax.stages.Wrapped]]
    """(state structure, compiled step) for each structure of state seen."""

    def _compute_loss(self, model, batch, key, reference=None) -> tuple[jax.Array, dict]:
        # What the loss computation logs with jit_log joins the model's metrics: averaged
        # over microbatches like them, and returned from the step like them.
        if lora.has_adapters(model):
            model = lora.with_dropout_keys(model, jax.random.fold_in(key, _LORA_DROPOUT_STREAM))
        with collecting() as logged:
            loss, metrics = self.objective.loss(
                self.mp.cast_to_compute(model), batch, key=key, **self._with_reference(reference)
            )
        return loss, {**metrics, **logged}

    def _loss_and_grad(self, model, batch, key, reference=None):
        """``((loss, metrics), grads)``, averaged over the microbatches. ``grads`` has the
        structure of :func:`trainable`'s part of the model. ``reference``: the objective's
        (:meth:`reference_of`), a constant of the step."""
        if lora.has_adapters(model):
            # Only the adapters are differentiated; the frozen weights are constants of the step.
            adapters_grad = eqx.filter_value_and_grad(
                lambda params, b, k: self._compute_loss(eqx.combine(params, model), b, k, reference), has_aux=True
            )

            def grad_fn(model, b, k):
                return adapters_grad(trainable(model), b, k)

        else:
            model_grad = eqx.filter_value_and_grad(self._compute_loss, has_aux=True)

            def grad_fn(model, b, k):
                return model_grad(model, b, k, reference)

        Batch = _batch_axis(batch, self.config.batch_axis)
        plan = self.plans[Batch.size]
        n = plan.num_microbatches
        if n == 1:
            return grad_fn(model, batch, key)
        Micro = Batch.resize(plan.microbatch_size)
        Steps = Axis("microbatch", n)

        def rest(x: NamedArray) -> tuple[Axis, ...]:
            return tuple(ax for ax in x.axes if ax.name != Batch.name)

        def split(x: NamedArray):
            return x.unflatten_axis(Batch.name, (Steps, Micro)).rearrange((Steps, Micro, *rest(x))).array

        def microbatch(arrays):
            return jax.tree.map(
                lambda a, x: hax.shard(hax.named(a, (Micro, *rest(x))), self.compute_mapping), arrays, batch
            )

        stacked = jax.tree.map(split, batch, is_leaf=lambda x: isinstance(x, NamedArray))

        def accumulate(carry, xs):
            sums, grad_sum = carry
            arrays, mb_key = xs
            values, grads = grad_fn(model, microbatch(arrays), mb_key)
            return (jax.tree.map(jnp.add, sums, values), jax.tree.map(jnp.add, grad_sum, grads)), None

        first = microbatch(jax.tree.map(lambda a: a[0], stacked))
        value_shapes = eqx.filter_eval_shape(self._compute_loss, model, first, key, reference)
        zero_values = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), value_shapes)
        init = (zero_values, jax.tree.map(jnp.zeros_like, trainable(model)))
        (sums, grad_sum), _ = jax.lax.scan(accumulate, init, (stacked, jax.random.split(key, n)))
        return jax.tree.map(lambda v: v / n, sums), jax.tree.map(lambda g: g / n, grad_sum)

    def _step(self, state: TrainerState, batch):
        key, next_key = jax.random.split(state.training_key)
        reference = self.reference_of(state.model, state.reference)
        (loss, model_metrics), grads = self._loss_and_grad(state.model, batch, key, reference)
        params = trainable(state.model)
        overwrites = None
        if self.quantization is not None:
            # FP8's scale histories come back as "gradients" that replace the state outright
            overwrites, grads = hax.quantization.partition_for_grad_overwrite(grads)
        optimizer = optax.with_extra_args_support(self.optimizer)
        extras = {
            "loss": loss,
            "objective": self._batch_objective(state.model, batch, reference),
            "key": jax.random.fold_in(state.training_key, _OPTIMIZER_STREAM),
            "step": state.step,
        }
        with collecting() as optimizer_logged:  # jit_log from the optimizer's update
            updates, opt_state = optimizer.update(grads, state.opt_state, params, **extras)
        model_metrics = {**model_metrics, **optimizer_logged}
        if overwrites is None:
            model = eqx.apply_updates(state.model, updates)
        else:
            model = hax.quantization.apply_updates(state.model, updates, overwrites)
        averaging = state.model_averaging
        if averaging is not None:
            averaging = averaging.update(model, state.step)
            if lora.has_adapters(model):  # only the adapters are averaged: the frozen base stays exact
                exact = eqx.combine(lora.adapter_params(averaging.model), model)
                averaging = eqx.tree_at(lambda a: a.model, averaging, exact)
        metrics = {**model_metrics, "train/loss": loss, "optim/grad_norm": optax.global_norm(grads)}
        if self.config.watch is not None:
            watched = {"params": trainable(model), "grads": grads, "updates": updates}
            metrics.update(watch_stats(self.config.watch, state.step + 1, watched))
        skipped = skipped_step(state.opt_state, opt_state)
        if skipped is not None:
            metrics["optim/skipped_step"] = skipped
        return TrainerState(state.step + 1, model, opt_state, next_key, averaging, state.reference), metrics

    def _batch_objective(self, model, batch, reference=None) -> BatchObjective:
        """The objective on this step's batch (its first microbatch when it is split) as a
        function of the trainable parameters, for the optimizer (:mod:`levanter_core.optim.step`)."""
        Batch = _batch_axis(batch, self.config.batch_axis)
        rows = self.plans[Batch.size].microbatch_size
        if rows < Batch.size:
            batch = jax.tree.map(
                lambda x: hax.shard(x[Batch.name, :rows], self.compute_mapping),
                batch,
                is_leaf=lambda x: isinstance(x, NamedArray),
            )

        def with_params(params):
            return self.mp.cast_to_compute(eqx.combine(params, model))

        def loss(params, key):
            return self._compute_loss(eqx.combine(params, model), batch, key, reference)[0]

        def sampled_loss(params, key):
            try:
                return self.objective.sampled_loss(with_params(params), batch, key=key)
            except NotImplementedError as e:
                raise ConfigError(
                    f"optimizer: this optimizer evaluates the loss against targets drawn from the model, "
                    f"but {e}; choose another optimizer (sophia-h rather than sophia-g, say)"
                ) from None

        return BatchObjective(loss, sampled_loss, lambda: self.objective.data_points(batch))

    def train_step(self, state: TrainerState, batch, batch_size: int | None = None):
        """One optimizer step on a global batch (a host batch as :meth:`to_device` takes, or the
        objective's example already on the mesh); returns (state, metrics).
        ``batch_size``: the global batch's size when ``batch`` holds only this process's rows of
        a batch of another size than the first of the schedule."""
        Batch = self.Batch if batch_size is None else self.batch_axis(batch_size)
        fields = self.objective.fields(batch)
        placed = any(isinstance(f.values, NamedArray) for f in fields.values())
        example = batch if placed else self._place(fields, Batch)
        leaves, structure = jax.tree.flatten(state)
        with hax.partitioning.set_mesh(self.mesh):
            leaves, metrics = self._flat_step(structure, leaves)(leaves, example)
        return jax.tree.unflatten(structure, leaves), metrics

    def compile_ahead(self, state: TrainerState, template, batch_size: int | None = None) -> None:
        """Compile the training step now for batches shaped like ``template`` (a host batch of
        ``batch_size`` sequences, default the schedule's first), so that it is ready when the
        first batch is: compilation then overlaps with whatever else start-up waits for (the
        data, typically)."""
        example = self.to_device(template, self.Batch if batch_size is None else self.batch_axis(batch_size))
        leaves, structure = jax.tree.flatten(state)
        with hax.partitioning.set_mesh(self.mesh):
            self._flat_step(structure, leaves).lower(leaves, example).compile()

    def _flat_step(self, structure, leaves: list) -> jax.stages.Wrapped:
        """The compiled step for states of this ``structure``, as a function of the state's leaves
        (donated) and the batch, returning the new leaves and the metrics. Calling it costs one
        flatten and one unflatten of the state; ``hax.named_jit`` would re-partition the whole state
        on every call (40 ms per step for the reference GPT-2, on the CPU the step runs on).
        The new state keeps each leaf's sharding, the parameter mapping's. Called with the mesh set."""
        for known, step in self._flat_steps:
            if known == structure:
                return step

        def flat_step(leaves, example):
            with hax.axis_mapping(self.compute_mapping), parallel_settings(**self.config.layer_settings):
                state, metrics = self._step(jax.tree.unflatten(structure, leaves), example)
            return jax.tree.leaves(state), metrics

        state = jax.tree.unflatten(structure, leaves)
        shardings = hax.partitioning.infer_resource_partitions(state, self.parameter_mapping)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        step = jax.jit(flat_step, donate_argnums=0, out_shardings=(jax.tree.leaves(shardings), replicated))
        self._flat_steps.append((structure, step))
        return step
