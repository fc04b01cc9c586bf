"""Training terms a layer adds to the loss (a mixture of experts' load balancing, say).

Layers produce them and the objective adds them, so the type sits with the layers; it is
also importable from :mod:`levanter_core.models.lm`, beside the model interface that returns it.
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp


class AuxiliaryLoss(eqx.Module):
    """Extra training terms a model computes in its forward pass (a mixture of experts'
    load-balancing loss, say).

    ``loss`` is added to the cross-entropy; every entry of ``metrics`` (scalars, e.g.
    ``moe/load_balancing_loss``) is logged with the step's other metrics. A model
    provides them by implementing ``activations_with_aux(input_ids, *, key)``, which
    returns ``(hidden, AuxiliaryLoss)``, alongside ``activations``."""

    loss: jnp.ndarray
    metrics: dict[str, jnp.ndarray]
