"""The Trainer: a jit-compiled training step, evaluation, and the loop around them.

One step takes the global batch, splits it into microbatches when
``per_device_parallelism`` asks for fewer sequences per device than the batch
holds (gradient accumulation), computes the loss in the compute precision of
``trainer.mp``, applies the optimizer (which receives the loss too, for
``optimizer.skip_bad_steps``) and folds the new weights into the averaged model
when ``trainer.model_averaging`` is on. The state is donated to the step, so
its buffers are reused in place. Metrics of step N are fetched from the device
only after step N+1 has been dispatched, so the host never stalls the device.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from haliax import Axis, NamedArray
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from levanter_core import lora
from levanter_core.errors import ConfigError, LevanterError
from levanter_core.objective import LmObjective, Objective, batch_totals, evaluate_batch
from levanter_core.optim.skipstep import skipped_step
from levanter_core.optim.step import BatchObjective
from levanter_core.tracker.jit_log import collecting
from levanter_core.trainer.config import TrainerConfig
from levanter_core.trainer.mesh import data_axis_size
from levanter_core.trainer.state import TrainerState
from levanter_core.trainer.watch import watch_stats

logger = logging.getLogger(__name__)

LossFn = Callable[..., tuple[jax.Array, dict]]
"""``loss_fn(model, example, *, key) -> (scalar, metrics)``: the mean loss of a batch (an
:class:`~levanter_core.models.lm.LmExample`) and any scalars the model wants logged (see
``levanter_core.models.lm.lm_loss_and_metrics``); given to :class:`Trainer` in place of an
objective, it trains next-token prediction with that loss."""


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


class NonFiniteLossError(LevanterError):
    """The loss became NaN or infinite and ``crash_on_nan``/``crash_on_inf`` asked to stop."""

    exit_code = 1


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """How the global batch is cut up across devices and microbatches.

    ``data_parallel_size`` is how many ways the batch is split (``replica_dcn x replica x data``
    devices). Batches are multiples of it, unless ``trainer.allow_nondivisible_batch_size``."""

    batch_size: int
    microbatch_size: int
    eval_batch_size: int
    data_parallel_size: int = 1

    @property
    def num_microbatches(self) -> int:
        return self.batch_size // self.microbatch_size

    def placement_mapping(self, mapping: dict[str, Any], Batch: Axis) -> dict[str, Any]:
        """The axis mapping to place a host batch of ``Batch`` rows on the mesh with:
        ``mapping`` itself, or ``mapping`` without ``Batch`` when the rows do not split evenly
        over the data-parallel devices. JAX cannot store an unevenly split array, so such a
        batch goes whole to every device, and the sharding constraints inside the step (which
        may be uneven) split the activations over the devices."""
        if Batch.size % self.data_parallel_size == 0:
            return mapping
        return {name: physical for name, physical in mapping.items() if name != Batch.name}

    @staticmethod
    def from_config(config: TrainerConfig, data_size: int, batch: int | None = None) -> BatchPlan:
        """The plan for ``config`` on ``data_size`` data-parallel devices, for batches of ``batch``
        sequences (default: the first of ``train_batch_size``'s schedule); a :class:`ConfigError`
        naming the field when the sizes do not fit."""
        if batch is None:
            batch = config.batch_schedule.size_at(0)
        if batch % data_size and not config.allow_nondivisible_batch_size:
            raise ConfigError(
                f"trainer.train_batch_size ({batch}) must be a multiple of the {data_size} data-parallel device(s) "
                "(devices / trainer.model_axis_size); choose a multiple, or set "
                "trainer.allow_nondivisible_batch_size: true to split it unevenly (at the cost of a copy of each "
                "batch on every device)"
            )
        per_device = config.per_device_parallelism
        micro = batch if per_device == -1 else per_device * data_size
        if micro > batch or batch % micro:
            raise ConfigError(
                f"trainer.train_batch_size ({batch}) must be a multiple of per_device_parallelism ({per_device}) "
                f"x {data_size} data-parallel device(s) = {micro}"
            )
        per_device_eval = config.per_device_eval_parallelism
        eval_batch = micro if per_device_eval == -1 else per_device_eval * data_size
        return BatchPlan(batch, micro, eval_batch, data_size)


ACTIVATION_AXES = ("position", "key_position")
"""Logical axes of every language model's activations that no parameter has (``LmConfig.Pos``,
``KeyPos``): compute mappings may name them (sequence parallelism), parameter mappings not."""


def _check_axis_names(config: TrainerConfig, parameter_axes: set[str]) -> None:
    """Every logical axis the config maps must be one the model has: a parameter axis for the
    parameter-only fields, and a parameter or activation axis for the others."""
    activation_axes = parameter_axes | {config.batch_axis, *ACTIVATION_AXES}
    fields: list[tuple[str, list[str], set[str]]] = [
        ("trainer.fsdp_axis", config.fsdp_axes, parameter_axes),
        ("trainer.parameter_axis_resources", list(config.parameter_axis_resources), parameter_axes),
        ("trainer.tensor_parallel_axes", list(config.tensor_parallel_axes or []), activation_axes),
        ("trainer.axis_resources", list(config.axis_resources), activation_axes),
        ("trainer.compute_axis_resources", list(config.compute_axis_resources), activation_axes),
    ]
    for field, names, known in fields:
        for name in names:
            if name == "heads" and field == "trainer.tensor_parallel_axes" and "kv_heads" in parameter_axes:
                continue  # Levanter's [mlp, heads]: here kv_heads (see TrainerConfig.tensor_parallel_axes)
            if name not in known:
                close = difflib.get_close_matches(name, sorted(known), n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ConfigError(
                    f"{field} names the axis {name!r}, which the model does not have. "
                    f"Its parameters have the axes {', '.join(sorted(parameter_axes))}"
                    + (
                        ""
                        if known is parameter_axes
                        else f"; its activations also {', '.join(sorted(known - parameter_axes))}"
                    )
                    + f".{hint}"
                )


_MESH_SIZE_SOURCE = {
    "replica_dcn": "trainer.replica_dcn_axis_size",
    "replica": "trainer.replica_ici_axis_size",
    "data": "the data axis size (devices / (model_axis_size x replica sizes))",
    "model": "trainer.model_axis_size",
}
"""Where each mesh axis's size comes from, for error messages."""


def _check_divisible(config: TrainerConfig, mapping: dict[str, Any], mesh: Mesh, path: str, array: NamedArray) -> None:
    """Each axis of ``array`` (a parameter or optimizer state at ``path``) must be divisible by
    the mesh axes the parameter mapping splits it over, each mesh axis used once."""
    used: dict[str, str] = {}
    for axis in array.axes:
        physical = mapping.get(axis.name)
        if physical is None:
            continue
        mesh_axes = (physical,) if isinstance(physical, str) else tuple(physical)
        for mesh_axis in mesh_axes:
            if mesh_axis in used:
                raise ConfigError(
                    f"{config.parameter_axis_field(axis.name)} splits {axis.name!r} over mesh axis {mesh_axis!r}, "
                    f"which {config.parameter_axis_field(used[mesh_axis])} already uses for {used[mesh_axis]!r} "
                    f"of the same array ({path}); map one of them to another mesh axis"
                )
            used[mesh_axis] = axis.name
        ways = math.prod(mesh.shape[a] for a in mesh_axes)
        if axis.size % ways:
            sizes = " x ".join(f"{a} ({mesh.shape[a]})" for a in mesh_axes)
            raise ConfigError(
                f"{config.parameter_axis_field(axis.name)} splits the axis {axis.name!r} over mesh axis {sizes}, "
                f"but {axis.name!r} has size {axis.size} in {path}, which is not a multiple of {ways}: JAX cannot "
                f"store a parameter split unevenly. Choose {' and '.join(_MESH_SIZE_SOURCE[a] for a in mesh_axes)} "
                f"to divide {axis.size}, a model whose {axis.name!r} is a multiple of {ways}, or do not split it"
            )


class Trainer:
    """Owns the compiled train and eval steps for one model/optimizer/mesh."""

    def __init__(
        self,
        config: TrainerConfig,
        optimizer: optax.GradientTransformation,
        objective: Objective | LossFn | None = None,
        *,
        mesh: Mesh,
        eval_loss_fn: Callable[..., jax.Array] | None = None,
        loss_fn: LossFn | None = None,
        eval_params: Callable[[Any, Any], Any] | None = None,
    ):
        """``objective`` (:mod:`levanter_core.objective`) says what a batch holds, what the
        step minimizes and what evaluation sums; a loss function in its place trains
        next-token prediction with it (``eval_loss_fn(model, example, *, key) -> scalar`` is
        then what evaluation reports, by default the loss function's first value).

        ``optimizer.update`` is called with the step's loss as the keyword argument ``loss``
        when it accepts extra arguments (``optax.GradientTransformationExtraArgs``, as
        ``OptimizerConfig.build_for_trainer`` makes); a plain optax optimizer works too.

        ``optimizer.update`` also receives ``objective``, ``key`` and ``step``, as
        :mod:`levanter_core.optim.step` describes.

        ``eval_params(params, opt_state) -> params``: the parameters to evaluate and export when
        they are not the trained ones (``OptimizerConfig.params_for_evaluation``; schedule-free
        optimizers evaluate an average of their iterates); None: the trained ones.

        ``loss_fn=``: the keyword this argument had before objectives existed (deprecated)."""
        self.config = config
        self.optimizer = optimizer
        self.eval_params = eval_params
        if loss_fn is not None:
            warnings.warn(
                "Trainer(loss_fn=...) is deprecated: pass the loss function (or an objective) as the third argument",
                DeprecationWarning,
                stacklevel=2,
            )
            if objective is not None:
                raise TypeError("give an objective or loss_fn, not both")
            objective = loss_fn
        if objective is None:
            raise TypeError("Trainer needs an objective (or a loss function)")
        if not isinstance(objective, Objective):
            objective = LmObjective(loss_fn=objective, eval_loss_fn=eval_loss_fn)
        self.objective = objective
        self.mesh = mesh
        self.mp: jmp.Policy = jmp.get_policy(config.mp)
        self.compute_mapping = config.compute_axis_mapping()
        self.parameter_mapping = config.parameter_axis_mapping()
        self.plan = BatchPlan.from_config(config, data_axis_size(mesh))
        # one plan per batch size of trainer.train_batch_size's schedule (the first is `plan`)
        data_size = data_axis_size(mesh)
        self.plans = {size: BatchPlan.from_config(config, data_size, size) for size in config.batch_schedule.sizes}
        self.plans[self.plan.batch_size] = self.plan
        quantization = config.quantization
        self.quantization = quantization.to_haliax() if quantization is not None and quantization.enabled else None
        self.Batch = Axis(config.batch_axis, self.plan.batch_size)
        self.EvalBatch = Axis(config.batch_axis, self.plan.eval_batch_size)
        self._flat_steps: list[tuple[Any, Callable]] = []  # (state structure, compiled step)
        self._eval_step = hax.named_jit(self._eval_loss, axis_resources=self.compute_mapping)
        self._eval_steps: dict[Callable, Callable] = {}
        self._totals_step: Callable | None = None
        self._local_rows: dict[int, np.ndarray] = {}

    # -- state ---------------------------------------------------------------------------
    def _fresh_state(self, model, training_key: jax.Array) -> TrainerState:
        """Step 0 around ``model``: parameter precision, a fresh optimizer state, and an
        average that starts at the model when averaging is on."""
        model = self.quantize(self.mp.cast_to_param(model))
        averaging = self.config.model_averaging
        reference = None
        if self.objective.keeps_reference and not lora.has_adapters(model):
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
        if self.quantization is None or _is_quantized(model):
            return model
        return hax.quantization.quantize_linear_layers(model, self.quantization)

    def batch_axis(self, size: int) -> Axis:
        """The batch axis of a global batch of ``size`` sequences (a size of the schedule)."""
        return Axis(self.config.batch_axis, size)

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
        _check_axis_names(self.config, parameter_axes)
        for path, array in arrays:
            _check_divisible(self.config, self.parameter_mapping, self.mesh, path, array)

    def reference_of(self, model, stored=None):
        """The reference model the objective compares ``model`` with
        (:attr:`~levanter_core.objective.Objective.keeps_reference`): ``stored`` (a state's
        ``reference``), else, for a model with LoRA adapters, the model without them; None for
        objectives that keep none."""
        if not self.objective.keeps_reference:
            return None
        if stored is not None:
            return stored
        if lora.has_adapters(model):
            return lora.base_model(model)
        raise ValueError(f"the {self.objective.name!r} objective compares with a reference model, but there is none")

    def _with_reference(self, reference) -> dict:
        """The ``reference=`` keyword for the objective's calls (none when it keeps no reference)."""
        if not self.objective.keeps_reference:
            return {}
        return {"reference": self.mp.cast_to_compute(reference)}

    # -- compiled pieces -------------------------------------------------------------------
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

    def _eval_loss(self, model, batch, reference=None):
        return self.objective.eval_loss(self.mp.cast_to_compute(model), batch, **self._with_reference(reference))

    # -- host side ---------------------------------------------------------------------------
    def local_rows(self, Batch: Axis) -> np.ndarray:
        """The rows of a global batch that this process's devices hold, in order: all of them in
        a single-process run; in a multi-process run, the only rows this process reads."""
        if Batch.size not in self._local_rows:
            sharding = self._sharding((Batch, Axis("position", 1)))
            rows: set[int] = set()
            for index in sharding.addressable_devices_indices_map((Batch.size, 1)).values():
                rows.update(range(*index[0].indices(Batch.size)))
            self._local_rows[Batch.size] = np.array(sorted(rows), np.int64)
        return self._local_rows[Batch.size]

    def _sharding(self, axes: tuple[Axis, ...]):
        """How an array of ``axes`` (the batch axis first) lies on the mesh."""
        mapping = self.plan.placement_mapping(self.compute_mapping, axes[0])
        return hax.partitioning.sharding_for_axis(axes, mapping, self.mesh)

    def to_device(self, batch, Batch: Axis):
        """A host batch as the objective's example laid out on the mesh (an
        :class:`~levanter_core.models.lm.LmExample` for language modelling). ``batch`` is what
        the run's data gives (token ids ``[rows, seq_len]``, or a ``data.Batch``), holding either
        the whole global batch or only this process's :meth:`local_rows`; each device receives
        just its own rows of each array the objective names."""
        return self._place(self.objective.fields(batch), Batch)

    def _place(self, fields: dict, Batch: Axis):
        """The objective's example of a host batch's ``fields`` (``BatchField`` s), on the mesh."""
        present = [f.values for f in fields.values() if f.values is not None]
        if not present:
            raise ValueError("the batch holds no array")
        count = len(present[0])
        rows = self.local_rows(Batch)
        if count not in (Batch.size, len(rows)):
            raise ValueError(
                f"a batch of {count} rows is neither the global batch ({Batch.size}) nor this process's {len(rows)}"
            )
        whole = count == Batch.size

        def put(field):
            if field.values is None:
                return None
            values = np.asarray(field.values, field.dtype)
            axes = (Batch, *(Axis(name, size) for name, size in zip(field.axes, values.shape[1:])))
            shape = tuple(ax.size for ax in axes)

            def piece(index):
                wanted = np.arange(Batch.size)[index[0]]
                return values[wanted if whole else np.searchsorted(rows, wanted)][(slice(None), *index[1:])]

            return hax.named(jax.make_array_from_callback(shape, self._sharding(axes), piece), axes)

        return self.objective.example({name: put(field) for name, field in fields.items()})

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

    def _flat_step(self, structure, leaves: list) -> Callable:
        """The compiled step for states of this ``structure``, as a function of the state's leaves
        (donated) and the batch, returning the new leaves and the metrics. Calling it costs one
        flatten and one unflatten of the state; ``hax.named_jit`` would re-partition the whole state
        on every call (40 ms per step for the reference GPT-2, on the CPU the step runs on).
        The new state keeps each leaf's sharding, the parameter mapping's. Called with the mesh set."""
        for known, step in self._flat_steps:
            if known == structure:
                return step

        def flat_step(leaves, example):
            with hax.axis_mapping(self.compute_mapping):
                state, metrics = self._step(jax.tree.unflatten(structure, leaves), example)
            return jax.tree.leaves(state), metrics

        state = jax.tree.unflatten(structure, leaves)
        shardings = hax.partitioning.infer_resource_partitions(state, self.parameter_mapping)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        step = jax.jit(flat_step, donate_argnums=0, out_shardings=(jax.tree.leaves(shardings), replicated))
        self._flat_steps.append((structure, step))
        return step

    def evaluate(
        self, model, batches: Iterator, fn: Callable[..., jax.Array] | None = None, *, reference=None
    ) -> float | None:
        """Mean loss over ``batches`` (each ``[eval_batch_size, seq_len]`` ids or a
        ``data.Batch``); None if there are none. ``fn(model, example, *, key)``: another scalar
        to average instead of the evaluation loss (the entropy, say). ``reference``: a state's
        reference model, for objectives that keep one (see :meth:`reference_of`)."""
        if fn is None:
            reference = self.reference_of(model, reference)

            def step(model, batch):
                return self._eval_step(model, batch, reference)

        else:
            step = self._eval_steps.get(fn)
            if step is None:
                step = self._eval_steps[fn] = hax.named_jit(
                    lambda model, batch: fn(self.mp.cast_to_compute(model), batch, key=None),
                    axis_resources=self.compute_mapping,
                )
        losses = []
        with hax.partitioning.set_mesh(self.mesh):
            for batch in batches:
                losses.append(step(model, self.to_device(batch, self.EvalBatch)))
        if not losses:
            return None
        return float(np.mean([float(x) for x in losses]))

    def evaluate_totals(self, model, batches: Iterator, *constants, reference=None) -> np.ndarray | None:
        """The objective's evaluation totals (:meth:`~levanter_core.objective.Objective.eval_totals`,
        with ``constants``; for language modelling ``[nats, tokens, bytes]`` given the bytes per
        token id) summed over ``batches``; None if there are none. Sums accumulate in float64 on
        the host. ``reference``: a state's reference model, for objectives that keep one (see
        :meth:`reference_of`)."""
        if self._totals_step is None:
            replicated = NamedSharding(self.mesh, PartitionSpec())

            def totals(model, batch, reference, *constants):
                found, outputs = evaluate_batch(
                    self.objective, self.mp.cast_to_compute(model), batch, *constants, **self._with_reference(reference)
                )
                # outputs are gathered whole onto every device, so that every process reads all of them
                return found, jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, replicated), outputs)

            self._totals_step = hax.named_jit(totals, axis_resources=self.compute_mapping)
        reference = self.reference_of(model, reference)
        parts = []
        with hax.partitioning.set_mesh(self.mesh):
            for batch in batches:
                found, outputs = self._totals_step(model, self.to_device(batch, self.EvalBatch), reference, *constants)
                parts.append(batch_totals(self.objective, found, outputs))
        if not parts:
            return None
        return np.sum(parts, axis=0)

    def check_finite(self, loss: float, step: int) -> None:
        if math.isnan(loss) and self.config.crash_on_nan:
            raise NonFiniteLossError(f"the training loss became NaN at step {step} (trainer.crash_on_nan is true)")
        if math.isinf(loss) and self.config.crash_on_inf:
            raise NonFiniteLossError(f"the training loss became infinite at step {step} (trainer.crash_on_inf is true)")


def _is_overwrite(x) -> bool:
    return isinstance(x, hax.quantization.OverwriteWithGradient)


def _is_quantized(model) -> bool:
    return any(_is_overwrite(x) for x in jax.tree.leaves(model, is_leaf=_is_overwrite))


def trainable(model):
    """The parameters the optimizer updates: every floating-point array, except the state of
    quantized layers (FP8 scales), which the step replaces instead of updating; in a model with
    LoRA adapters (:mod:`levanter_core.lora`), the adapters alone."""
    if lora.has_adapters(model):
        return lora.adapter_params(model)
    params = eqx.filter(model, eqx.is_inexact_array)
    if not _is_quantized(model):
        return params
    return eqx.filter(params, lambda x: not _is_overwrite(x), is_leaf=_is_overwrite)


class Prefetcher:
    """Builds the next batches on a background thread while the device trains."""

    def __init__(self, make_batch: Callable[[int], np.ndarray], start: int, stop: int, depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, args=(make_batch, start, stop), daemon=True)
        self._stopped = threading.Event()
        self._thread.start()

    def _run(self, make_batch, start, stop):
        for step in range(start, stop):
            if self._stopped.is_set():
                return
            try:
                item = (step, make_batch(step), None)
            except BaseException as e:  # surfaced to the training thread by get()
                item = (step, None, e)
            while not self._stopped.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return

    def get(self) -> tuple[int, np.ndarray]:
        step, batch, error = self._queue.get()
        if error is not None:
            raise error
        return step, batch

    def close(self) -> None:
        self._stopped.set()


class Throughput:
    """Tokens per second over the steps since the first one (which includes compilation).

    A step's time runs from one :meth:`tick` to the next, less the time spent between
    :meth:`pause` and :meth:`resume` (evaluation, saving a checkpoint): only training counts,
    whichever way the ticks and the pauses interleave."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self._last: float | None = None
        self._paused_at: float | None = None
        self._paused = 0.0  # seconds paused since the last tick
        self.step_times: list[float] = []

    def pause(self) -> None:
        """Stop counting time until :meth:`resume`: what follows is not training."""
        if self._paused_at is None:
            self._paused_at = time.perf_counter()

    def resume(self) -> None:
        """Count time again."""
        if self._paused_at is not None:
            self._paused += time.perf_counter() - self._paused_at
            self._paused_at = None

    def tick(self) -> float | None:
        """Mark the end of a step; its tokens per second (None for the first tick, or for a step
        that took no time at all)."""
        now = time.perf_counter()
        if self._paused_at is not None:  # ticked while paused: the pause so far ends this step
            self._paused += now - self._paused_at
            self._paused_at = now
        rate = None
        if self._last is not None:
            dt = now - self._last - self._paused
            if dt > 0:
                self.step_times.append(dt)
                rate = self.tokens_per_step / dt
        self._last, self._paused = now, 0.0
        return rate
