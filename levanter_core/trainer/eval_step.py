"""The Trainer's compiled evaluation: the mean evaluation loss (or another scalar) over batches,
and the objective's evaluation totals summed over them on the host."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import haliax as hax
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from levanter_core.layers.parallel import parallel_settings
from levanter_core.objective import batch_totals, evaluate_batch
from levanter_core.trainer.placement import BatchPlacement


class EvalStep(BatchPlacement):
    """The evaluation part of the Trainer."""

    _eval_step: Callable
    """The evaluation loss, compiled."""
    _eval_steps: dict[Callable, Callable]
    """Another scalar to average (``evaluate``'s ``fn``), compiled, by function."""
    _totals_step: Callable | None
    """The evaluation totals, compiled once first used."""

    def _eval_loss(self, model, batch, reference=None):
        return self.objective.eval_loss(self.mp.cast_to_compute(model), batch, **self._with_reference(reference))

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
            compiled = self._eval_steps.get(fn)
            if compiled is None:
                compiled = self._eval_steps[fn] = hax.named_jit(
                    lambda model, batch: fn(self.mp.cast_to_compute(model), batch, key=None),
                    axis_resources=self.compute_mapping,
                )
            step = compiled
        losses = []
        with hax.partitioning.set_mesh(self.mesh), parallel_settings(**self.config.layer_settings):
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
        with hax.partitioning.set_mesh(self.mesh), parallel_settings(**self.config.layer_settings):
            for batch in batches:
                found, outputs = self._totals_step(model, self.to_device(batch, self.EvalBatch), reference, *constants)
                parts.append(batch_totals(self.objective, found, outputs))
        if not parts:
            return None
        return np.sum(parts, axis=0)
