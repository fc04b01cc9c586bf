"""RMNP, row-momentum normalized preconditioning (https://github.com/Dominator-Index/RMNP):
``type: rmnp``, as Levanter's current ``optim/rmnp.py`` has it.

RMNP is Muon with the orthogonalization replaced by a cheaper normalization: each row of a
weight matrix's momentum (an output unit's weights over all inputs) is scaled to unit norm::

    B_t = momentum B_{t-1} + G_t
    M_t = momentum B_t + G_t                      (nesterov; else M_t = B_t)
    D_t[i, :] = M_t[i, :] / max(|M_t[i, :]|, rmnp_epsilon)
    W_t = W_{t-1} - lr_t (scale * D_t + weight_decay W_{t-1})

for each hidden weight matrix (``d_out x d_in``, its output and input axes flattened; each layer
of a stacked model its own matrix), with ``scale = sqrt(max(1, d_out / d_in))`` or, with
``use_kimi_scaling``, ``0.2 sqrt(max(d_out, d_in))``. Embeddings, the LM head, norms and biases
get AdamW, as with Muon (:mod:`levanter_optim_contrib.muon`).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import optax
from pydantic import Field, model_validator

from levanter_core.optim import OptimizerConfig
from levanter_optim_contrib.muon import matrices_and_adamw, scale_by_matrix_momentum
from levanter_optim_contrib.orthogonalize import shape_scale


def row_normalized(eps: float, kimi: bool = False):
    """For :func:`~levanter_optim_contrib.orthogonalize.map_matrices`: each row of each
    ``(d_out, d_in)`` matrix divided by its L2 norm (at least ``eps``), times the shape's scale."""

    def fn(x: jax.Array) -> jax.Array:
        norms = jnp.linalg.norm(x, axis=-1, keepdims=True)
        return x / jnp.maximum(norms, eps) * shape_scale(x.shape[-2], x.shape[-1], kimi)

    return fn


def scale_by_rmnp(
    momentum: float = 0.95, nesterov: bool = True, eps: float = 1e-8, kimi: bool = False
) -> optax.GradientTransformation:
    """RMNP's direction for trees of weight matrices: the (Nesterov) momentum of the gradients
    with each output row normalized, scaled for the matrix's shape."""
    return scale_by_matrix_momentum(row_normalized(eps, kimi), momentum, nesterov)


class RmnpConfig(OptimizerConfig):
    """RMNP for the weight matrices of the hidden linear layers, AdamW for the other parameters
    (which parameters are which follows Levanter, as for Muon).

    ``learning_rate`` (with the shared schedule) is RMNP's; ``adam_lr`` is AdamW's peak, on a
    schedule of the same shape. As in Levanter, ``lr`` is left over and has no effect (setting it
    warns); ``max_grad_norm`` clips AdamW's gradients only, and null turns it off."""

    learning_rate: float = Field(6e-4, ge=0)
    """RMNP's peak learning rate (the matrices'), reached at the end of warmup."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay of the matrices (scaled by RMNP's learning rate), and of AdamW's
    parameters unless ``adam_weight_decay`` is set; on the parameters ``weight_decay_modules`` /
    ``default_weight_decay_mask`` select."""
    adam_weight_decay: float | None = Field(None, ge=0)
    """AdamW's decoupled weight decay. None: ``weight_decay``."""
    lr: float = 0.02
    """No effect (as in Levanter): ``learning_rate`` is RMNP's learning rate. Setting it warns."""
    adam_lr: float = Field(6e-4, ge=0)
    """AdamW's peak learning rate, for the embeddings, LM head, norms and biases."""
    momentum: float = Field(0.95, ge=0, lt=1)
    """Decay of the momentum ``B <- momentum B + G`` (a sum of gradients, not an average)."""
    nesterov: bool = True
    """Normalize Nesterov's look-ahead ``momentum B + G`` rather than ``B`` itself."""
    rmnp_epsilon: float = Field(1e-8, gt=0)
    """The least norm a row is divided by (keeps an all-zero row at zero)."""
    use_kimi_scaling: bool = False
    """Scale each matrix's update by ``0.2 * sqrt(max(d_out, d_in))`` instead of
    ``sqrt(max(1, d_out / d_in))`` (then AdamW's learning rate and weight decay carry over)."""
    beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW's decay rate of the running mean of gradients."""
    beta2: float = Field(0.95, ge=0, lt=1)
    """AdamW's decay rate of the running mean of squared gradients."""
    epsilon: float = Field(1e-8, ge=0)
    """AdamW's epsilon, added to the root of the second moment."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the gradients of AdamW's parameters to this global L2 norm. None: no clipping."""

    @model_validator(mode="after")
    def _warn_unused_lr(self):
        if "lr" in self.model_fields_set:
            warnings.warn(
                f"optimizer.lr ({self.lr}) has no effect (as in Levanter): RMNP's learning rate is "
                "optimizer.learning_rate and AdamW's is optimizer.adam_lr",
                UserWarning,
                stacklevel=2,
            )
        return self

    def build(self, num_train_steps: int) -> optax.GradientTransformation:
        """RMNP on the hidden weight matrices, AdamW on the rest (``optax.partition``)."""
        rmnp = scale_by_rmnp(self.momentum, self.nesterov, self.rmnp_epsilon, self.use_kimi_scaling)
        adam_decay = self.weight_decay if self.adam_weight_decay is None else self.adam_weight_decay
        return matrices_and_adamw(
            self, rmnp, num_train_steps, label="rmnp", adam_lr=self.adam_lr, adam_weight_decay=adam_decay,
            beta1=self.beta1, beta2=self.beta2, epsilon=self.epsilon, max_grad_norm=self.max_grad_norm,
        )  # fmt: skip
