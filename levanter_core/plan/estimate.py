"""One plan: the config's real training step compiled ahead of time for the devices of this
process (simulated CPU devices standing in for the accelerators), and what it says about memory,
FLOPs, communication and time on the accelerator named.

Nothing of the model is allocated: the state is :meth:`Trainer.state_template` (shapes, dtypes
and shardings), the batch is a batch of zeros of the run's shape, and the step is lowered and
compiled exactly as ``levanter train`` compiles it (``Trainer._flat_step``), for as many devices
as the process has. The compiled program is the per-device (SPMD) program, so its buffer
assignment gives each device's memory, and its HLO the collectives each device takes part in.

The time is a roofline of three parts, with the constants below written down rather than
tuned per case:

* compute: the model's FLOPs per device (:meth:`LmConfig.flops_per_token`, the full attention
  map counted, as Levanter and Megatron-LM count) at :data:`COMPUTE_EFFICIENCY` of the
  accelerator's dense peak for the compute dtype;
* communication: each collective's ring traffic (:mod:`levanter_core.plan.hlo`) over the link it
  crosses (within a node, or across nodes), overlapped with compute where XLA can hide it
  (:data:`OVERLAP`);
* the optimizer's update, bound by memory bandwidth: parameters, gradients and optimizer state
  read and written once per step.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import Axis, NamedArray

from levanter_core.config.train import objective_class
from levanter_core.data.dataset.stream import _assemble
from levanter_core.errors import ConfigError
from levanter_core.models.lm import DEFAULT_BLOCK_LOGITS
from levanter_core.plan.hardware import Accelerator, from_device_kind
from levanter_core.plan.hlo import collectives
from levanter_core.trainer.checks import (
    check_batch_sizes,
    check_context_split,
    check_expert_split,
    check_pipeline_split,
)
from levanter_core.trainer.mesh import data_axis_size, make_mesh
from levanter_core.trainer.trainable import trainable
from levanter_core.trainer.trainer import Trainer

COMPUTE_EFFICIENCY = 0.6
"""Fraction of the dense peak a large transformer's training step reaches in FLOPs done (the
model's, and what gradient checkpointing recomputes: :data:`RECOMPUTE`). One constant for every
accelerator, chosen as the one that puts four reference points within 35% (bench/RESULTS.md,
2026-11-29): the 1 B Llama measured on one H200, and the published figures of torchtitan (Llama
3.1 8B on 8 H100s) and MaxText (Llama 3.1 8B on 256 v6e, Llama 2 70B on 512 v5p)."""

OVERLAP = 0.8
"""Share of the compute time under which collectives can hide (XLA's latency-hiding scheduler
overlaps each layer's gathers and reductions with the neighbouring layers' compute, but not the
first gather nor the last reduction, nor collectives on the critical path)."""

RECOMPUTE = {
    False: 1.0,
    "save_all": 1.0,
    True: 4 / 3,
    "offload": 4 / 3,
    "recompute": 4 / 3,
    "full": 4 / 3,
    "nested": 5 / 3,
}
"""FLOPs done per model FLOP under each ``gradient_checkpointing`` policy: a layer's forward pass
is a third of its forward and backward, and is done once more where its inside is recomputed
(twice for ``nested``, whose outer level recomputes the inner level's saved inputs too)."""

USABLE_MEMORY = 0.95
"""Share of a device's memory a run can count on: the runtime, the compiled code and the
allocator's fragmentation take the rest."""


@dataclasses.dataclass
class Memory:
    """Bytes per device."""

    parameters: int
    trainable: int
    optimizer: int
    gradients: int
    reference: int
    other_state: int
    activations: int
    temporaries: int
    arguments: int
    outputs: int
    aliased: int
    peak: int

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def _per_device_bytes(leaf) -> int:
    """Bytes one device holds of an abstract array (its sharding's shard shape)."""
    array = leaf.array if isinstance(leaf, NamedArray) else leaf
    if not hasattr(array, "shape"):
        return 0
    sharding = getattr(array, "sharding", None)
    shape = sharding.shard_shape(array.shape) if sharding is not None else array.shape
    return math.prod(shape) * jnp.dtype(array.dtype).itemsize


def tree_bytes(tree) -> int:
    """Bytes per device of every array in ``tree``."""
    return sum(_per_device_bytes(x) for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, NamedArray)))


def _residual_bytes(trainer, model, fields: dict[str, tuple[tuple[Axis, ...], Any]], reference=None) -> int:
    """Bytes the backward pass keeps from the forward pass of one batch shaped ``fields``
    (``name -> (axes, dtype)``): the residuals of the loss's ``vjp``, shapes only."""

    def residuals(arrays, model, reference):
        example = trainer.objective.example(
            {name: None if spec is None else hax.named(arrays[name], spec[0]) for name, spec in fields.items()}
        )

        def loss(params):
            full = eqx.combine(params, model)
            ref = trainer.reference_of(full, reference)
            return trainer._compute_loss(full, example, jax.random.PRNGKey(0), ref)[0]

        return jax.vjp(loss, trainable(model))[1]

    abstract = {
        name: jax.ShapeDtypeStruct(tuple(a.size for a in spec[0]), spec[1])
        for name, spec in fields.items()
        if spec is not None
    }
    shapes = jax.eval_shape(residuals, abstract, model, reference)
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(shapes))


def activation_bytes(trainer, model, template_fields: dict, rows: int, devices: int, reference=None) -> int:
    """Activations kept for the backward pass per device: the residuals of a forward pass over
    ``rows`` rows (a microbatch) less those of the model alone (measured at 1 and 2 rows, so that
    weights the backward pass keeps do not count), spread evenly over the ``devices``: each
    data-parallel device holds its rows' share, and tensor, context and expert splits divide
    each row's (an estimate: the compiled program's temporaries are exact, but not broken down)."""

    def shaped(n: int) -> dict:
        return {
            name: None if spec is None else ((spec[0][0].resize(n), *spec[0][1:]), spec[1])
            for name, spec in template_fields.items()
        }

    one = _residual_bytes(trainer, model, shaped(1), reference)
    two = _residual_bytes(trainer, model, shaped(2), reference)
    per_row = max(two - one, 0)
    return int(per_row * rows / max(devices, 1))


@dataclasses.dataclass
class Timing:
    compute_s: float
    communication_s: float
    exposed_communication_s: float
    optimizer_s: float
    step_s: float
    tokens_per_second_per_device: float
    mfu: float


def roofline(
    hardware: Accelerator,
    *,
    model_flops_per_device: float,
    compute_dtype: str,
    recompute: float = 1.0,
    link_bytes: float,
    network_bytes: float,
    state_bytes: int,
    tokens_per_step: int,
    devices: int,
) -> Timing:
    """The predicted step time of a step that does ``model_flops_per_device`` on each device
    (``recompute`` times that, with what gradient checkpointing recomputes) and sends
    ``link_bytes`` over the fast interconnect and ``network_bytes`` across nodes."""
    peak = hardware.matmul_tflops(compute_dtype) * 1e12
    compute = model_flops_per_device * recompute / (peak * COMPUTE_EFFICIENCY)
    communication = link_bytes / (hardware.link_gb_s * 1e9) + network_bytes / (hardware.network_gb_s * 1e9)
    exposed = max(0.0, communication - OVERLAP * compute)
    optimizer = 2 * state_bytes / (hardware.hbm_gb_s * 1e9)
    step = compute + exposed + optimizer
    mfu = model_flops_per_device / (step * hardware.bf16_tflops * 1e12)
    return Timing(compute, communication, exposed, optimizer, step, tokens_per_step / step / devices, mfu)


def _node_of(device: int, hardware: Accelerator) -> int:
    return device // hardware.node_devices


def communication(hlo: str, devices: int, hardware: Accelerator) -> dict:
    """Bytes each device sends per step, by kind of collective and by link."""
    by_kind: dict[str, float] = {}
    link = network = 0.0
    for c in collectives(hlo, devices):
        sent = c.sent_bytes() * c.count
        by_kind[c.kind] = by_kind.get(c.kind, 0.0) + sent
        if len({_node_of(d, hardware) for d in c.group}) > 1:
            network += sent
        else:
            link += sent
    return {"by_kind": by_kind, "link_bytes": link, "network_bytes": network}


def plan_step(config, hardware: Accelerator, *, model_config, Vocab: Axis, objective, adapt=None) -> dict:
    """Compile ``config``'s training step for this process's devices and estimate it on
    ``hardware`` (see the module docstring). ``config`` has its batch size worked out for the
    devices; ``model_config``, ``Vocab``, the ``objective`` and ``adapt`` (the function that puts
    LoRA adapters on, or None) are what the run resolves and builds from it
    (:mod:`levanter_core.run.initial`). Returns the plan as JSON-able data."""
    devices = jax.device_count()
    mesh = make_mesh(config.trainer)
    check_batch_sizes(config.trainer, data_axis_size(mesh))
    check_context_split(config.trainer, config.train_length, dict(mesh.shape))
    check_expert_split(config.trainer, config.model, dict(mesh.shape))
    check_pipeline_split(config.trainer, config.model, dict(mesh.shape), data_axis_size(mesh))

    if hardware.backend != jax.default_backend() and getattr(model_config, "cross_entropy_block_size", 0) is None:
        # the loss's blocks as the target's backend would cut them, not as this CPU would
        logits = DEFAULT_BLOCK_LOGITS.get(hardware.backend, DEFAULT_BLOCK_LOGITS["gpu"])
        model_config = model_config.model_copy(update={"cross_entropy_block_size": max(1, logits // Vocab.size)})
    trainer_cfg = config.trainer
    optimizer = config.optimizer.build_for_trainer(trainer_cfg.num_train_steps)
    trainer = Trainer(
        trainer_cfg, optimizer, objective, mesh=mesh, eval_params=config.optimizer.params_for_evaluation
    )  # fmt: skip
    key = jax.random.PRNGKey(trainer_cfg.seed)

    def model_init(key):
        model = model_config.build(Vocab, key=key)
        return model if adapt is None else adapt(model)

    trainer.check_sharding(model_init, key)  # a mapping the model's axes do not divide: the run's message
    started = time.perf_counter()
    state = trainer.state_template(model_init, key)
    packed = any(source.format.packed for source in config.data.configs.values()) if config.data.configs else False
    trained_config = model_config.model_copy(update={"seq_len": config.train_length})
    lengths = objective_class(model_config, config).row_lengths(trained_config)
    batch_size = trainer.Batch.size
    template = _assemble(
        batch_size, config.train_length, [], packed, {name: (n, np.dtype(np.float32)) for name, n in lengths.items()}
    )
    params = tree_bytes(state.model)
    trainable_bytes = _trainable_bytes(state.model)
    optimizer_bytes = tree_bytes(state.opt_state)
    reference = tree_bytes(state.reference) if state.reference is not None else 0
    averaging = tree_bytes(state.model_averaging) if state.model_averaging is not None else 0
    usable = int(hardware.memory_bytes * USABLE_MEMORY)
    resident = params + optimizer_bytes + trainable_bytes + reference + averaging
    shape = dict(mesh.shape)
    if resident > usable:
        # the state and its gradients alone do not fit: no need to compile the step to say so
        compiled_step, hlo = False, ""
        arguments = outputs = aliased = temporaries = activations = 0
        peak = resident
    else:
        example = trainer.to_device(template, trainer.Batch)
        leaves, structure = jax.tree.flatten(state)
        with hax.partitioning.set_mesh(mesh):
            lowered = trainer._flat_step(structure, leaves).lower(leaves, example)
        compiled = lowered.compile()
        compiled_step, hlo = True, compiled.as_text() or ""
        analysis = compiled.memory_analysis()
        assert analysis is not None  # XLA's CPU backend gives it
        arguments, outputs = int(analysis.argument_size_in_bytes), int(analysis.output_size_in_bytes)
        aliased, temporaries = int(analysis.alias_size_in_bytes), int(analysis.temp_size_in_bytes)
        # XLA's own peak (buffer assignment's) where it counts the temporaries; else the usual sum
        peak = max(int(getattr(analysis, "peak_memory_in_bytes", 0) or 0), arguments + outputs - aliased + temporaries)
        fields = _template_fields(template, trainer)
        activations = activation_bytes(
            trainer, state.model, fields, trainer.plan.microbatch_size, devices, state.reference
        )
    compile_seconds = time.perf_counter() - started

    memory = Memory(
        parameters=params, trainable=trainable_bytes, optimizer=optimizer_bytes, gradients=trainable_bytes,
        reference=reference, other_state=averaging, activations=activations, temporaries=temporaries,
        arguments=arguments, outputs=outputs, aliased=aliased, peak=peak,
    )  # fmt: skip

    tokens_per_step = batch_size * config.train_length
    trained = model_config.model_copy(update={"seq_len": config.train_length})
    flops_per_token = trained.flops_per_token(Vocab.size)
    if flops_per_token is not None:
        flops_per_token *= trainer.objective.flops_scale
    model_flops = (flops_per_token or 0.0) * tokens_per_step
    comm = communication(hlo, devices, hardware)
    timing = roofline(
        hardware,
        model_flops_per_device=model_flops / devices,
        compute_dtype=jnp.dtype(trainer.mp.compute_dtype).name,
        recompute=RECOMPUTE.get(getattr(model_config, "gradient_checkpointing", False), 4 / 3),
        link_bytes=comm["link_bytes"],
        network_bytes=comm["network_bytes"],
        state_bytes=trainable_bytes * 2 + optimizer_bytes,
        tokens_per_step=tokens_per_step,
        devices=devices,
    )
    return {
        "devices": devices,
        "device": hardware.name,
        "mesh": {name: size for name, size in shape.items() if size != 1} or {"data": 1},
        "model": model_config.type,
        "vocab_size": Vocab.size,
        "batch_size": batch_size,
        "seq_len": config.train_length,
        "microbatches": trainer.plan.num_microbatches,
        "gradient_checkpointing": getattr(model_config, "gradient_checkpointing", None),
        "parameters": _count(state.model),
        "trainable_parameters": _count(eqx.filter_eval_shape(trainable, state.model)),
        "memory": memory.as_dict(),
        "usable_memory_bytes": usable,
        "fits": peak <= usable,
        "model_flops_per_step": model_flops,
        "flops_per_token": flops_per_token,
        "communication": comm,
        "timing": dataclasses.asdict(timing),
        "tokens_per_step": tokens_per_step,
        "compiled": compiled_step,
        "compile_seconds": compile_seconds,
    }


def _trainable_bytes(model) -> int:
    """Bytes per device of the trained parameters (:func:`trainable`) of an abstract ``model``:
    its arrays at the places (key paths) where ``trainable`` keeps one."""

    def paths(tree) -> dict:
        flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, NamedArray))[0]
        return {jax.tree_util.keystr(path): leaf for path, leaf in flat}

    def present(leaf) -> bool:  # a NamedArray whose array ``trainable`` dropped is not kept
        return (leaf.array if isinstance(leaf, NamedArray) else leaf) is not None

    kept = {path for path, leaf in paths(eqx.filter_eval_shape(trainable, model)).items() if present(leaf)}
    return sum(_per_device_bytes(leaf) for path, leaf in paths(model).items() if path in kept)


def _count(tree) -> int:
    """Elements of every array in ``tree`` (parameters, for a model)."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, NamedArray))
    arrays = [x.array if isinstance(x, NamedArray) else x for x in leaves]
    return sum(math.prod(a.shape) for a in arrays if hasattr(a, "shape"))


def _template_fields(template, trainer) -> dict:
    """``name -> (axes, dtype)`` of the arrays a batch of ``template``'s shape gives the objective."""
    fields = trainer.objective.fields(template)
    out: dict[str, Any] = {}
    for name, field in fields.items():
        if field.values is None:
            out[name] = None
            continue
        values = np.asarray(field.values, field.dtype)
        axes = (trainer.Batch, *(Axis(n, size) for n, size in zip(field.axes, values.shape[1:])))
        out[name] = (axes, values.dtype)
    return out


def host_accelerator() -> Accelerator:
    """This machine as the plan's accelerator, for CPU devices: its physical memory shared evenly
    among JAX's local devices (rates are not needed for a memory check, and are nominal)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(jax.local_device_count(), 1)
    return Accelerator(
        "this machine's CPU", memory, 1.0, 1.0, 10.0, 10.0, 1.0, jax.local_device_count(), ("/proc/meminfo",)
    )


def check_fits(config, *, model_config, Vocab: Axis, objective, adapt=None) -> dict:
    """``trainer.plan_check``: the plan of this run on its own devices; a :class:`ConfigError`
    with its memory per device when the peak would not fit a device."""
    hardware = from_device_kind(jax.devices()[0].device_kind) or host_accelerator()
    plan = plan_step(config, hardware, model_config=model_config, Vocab=Vocab, objective=objective, adapt=adapt)
    m = plan["memory"]
    gib = 1024**3
    summary = (
        f"peak {m['peak'] / gib:,.2f} GiB per device (parameters {m['parameters'] / gib:,.2f}, optimizer state "
        f"{m['optimizer'] / gib:,.2f}, temporaries {m['temporaries'] / gib:,.2f} GiB, activations among them about "
        f"{m['activations'] / gib:,.2f}) of {plan['usable_memory_bytes'] / gib:,.2f} GiB usable on {hardware.name}"
    )
    if not plan["fits"]:
        raise ConfigError(
            f"trainer.plan_check: this run will not fit: {summary}. Use more devices, FSDP over more of them "
            "(trainer.mesh), gradient checkpointing (model.gradient_checkpointing), smaller microbatches "
            "(trainer.per_device_parallelism) or a smaller trainer.train_batch_size; `levanter plan` shows the options"
        )
    print(f"plan check: {summary}: fits", flush=True)
    return plan
