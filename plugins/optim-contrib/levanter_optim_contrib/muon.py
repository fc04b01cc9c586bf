"""Muon (Keller Jordan, 2024, https://kellerjordan.github.io/posts/muon/): ``type: muon``.

Muon updates each weight matrix of the hidden linear layers by its orthogonalized momentum,
and everything else (embeddings, the LM head, norms, biases) by AdamW::

    B_t = momentum B_{t-1} + G_t
    M_t = momentum B_t + G_t        (nesterov; else M_t = B_t)
    W_t = W_{t-1} - lr_t (scale * NewtonSchulz(M_t) + weight_decay W_{t-1})

``NewtonSchulz`` (:mod:`levanter_optim_contrib.orthogonalize`) takes ``M = U S V^T`` to about
``U V^T``; ``scale`` is ``sqrt(max(1, d_out / d_in))``, or ``0.2 sqrt(max(d_out, d_in))`` with
``use_kimi_scaling``. A weight with several input or output axes is one matrix (its axes
flattened), and each layer of a stacked model and each expert of a mixture-of-experts layer is
its own matrix.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax
from pydantic import Field, model_validator

from levanter_core.optim import OptimizerConfig
from levanter_optim_contrib.orthogonalize import label_matrices, map_matrices, orthogonalized

PyTree = Any


class ScaleByMuonState(NamedTuple):
    momentum: PyTree  # B_t, the running sum of gradients (not an average)


def scale_by_matrix_momentum(
    normalize: Callable[[jax.Array], jax.Array], momentum: float = 0.95, nesterov: bool = True
) -> optax.GradientTransformation:
    """The direction of a momentum-then-normalize optimizer (Muon, RMNP) for trees whose arrays
    are all weight matrices: the (Nesterov) momentum of the gradients, each matrix then passed
    through ``normalize`` as a ``(..., d_out, d_in)`` array (see
    :func:`~levanter_optim_contrib.orthogonalize.map_matrices`). The learning rate and weight
    decay are applied after it."""

    def init(params):
        return ScaleByMuonState(optax.tree.zeros_like(params))

    def update(grads, state, params=None):
        del params
        buf = jax.tree.map(lambda b, g: momentum * b + g, state.momentum, grads)
        direction = jax.tree.map(lambda b, g: momentum * b + g, buf, grads) if nesterov else buf
        return map_matrices(normalize, direction), ScaleByMuonState(buf)

    return optax.GradientTransformation(init, update)


def scale_by_muon(
    momentum: float = 0.95, nesterov: bool = True, steps: int = 5, eps: float = 1e-8, kimi: bool = False
) -> optax.GradientTransformation:
    """Muon's direction: the (Nesterov) momentum of each weight matrix's gradients,
    orthogonalized by ``steps`` Newton-Schulz iterations and scaled for the matrix's shape."""
    return scale_by_matrix_momentum(orthogonalized(steps, eps, kimi), momentum, nesterov)


def matrices_and_adamw(
    config: OptimizerConfig,
    direction: optax.GradientTransformation,
    num_train_steps: int,
    *,
    label: str,
    adam_lr: float,
    adam_weight_decay: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    max_grad_norm: float | None,
) -> optax.GradientTransformation:
    """``direction`` (then decoupled weight decay and the schedule of ``learning_rate``) on the
    hidden weight matrices, AdamW (clipped to ``max_grad_norm``, its peak ``adam_lr`` on a
    schedule of the same shape) on the other parameters, split as Levanter splits them. ``label``
    names the matrices' part in the optimizer's state (``muon``, ``rmnp``), as checkpoints hold it."""
    decay_mask = config.build_weight_decay_mask()
    weight_decay = float(getattr(config, "weight_decay", 0.0))
    matrices = [direction]
    if weight_decay > 0:
        matrices.append(optax.add_decayed_weights(weight_decay, decay_mask))
    matrices.append(optax.scale_by_learning_rate(config.lr_scheduler(num_train_steps)))
    adam = []
    if max_grad_norm is not None:
        adam.append(optax.clip_by_global_norm(max_grad_norm))
    adam.append(optax.scale_by_adam(beta1, beta2, epsilon))
    if adam_weight_decay > 0:
        adam.append(optax.add_decayed_weights(adam_weight_decay, decay_mask))
    adam.append(optax.scale_by_learning_rate(config.lr_scheduler(num_train_steps, learning_rate=adam_lr)))
    return optax.partition(
        {label: optax.chain(*matrices), "adamw": optax.chain(*adam)},
        lambda params: label_matrices(params, label, "adamw"),
    )


class MuonConfig(OptimizerConfig):
    """Muon for the weight matrices of the hidden linear layers, AdamW for the other parameters.

    ``learning_rate`` (with the shared schedule) is Muon's; ``adam_lr`` is AdamW's peak, on a
    schedule of the same shape. Which parameters are Muon's follows Levanter: the weights of
    linear layers (``haliax.nn.Linear``; also a mixture-of-experts router), except any whose path
    contains ``lm_head``; their biases, the embeddings and the norms go to AdamW.

    Differences from Levanter: ``lr`` has no effect here either, and saying so is a warning;
    the routed experts of a mixture-of-experts layer are Muon's, each expert orthogonalized on
    its own (Levanter matches only ``Linear`` and leaves ``MoELinear`` experts to AdamW); the
    default scaling works for any order of a weight's axes (Levanter's requires the output axes
    first); ``max_grad_norm`` is turned off by null (not 0), as in the core's AdamW.
    """

    learning_rate: float = Field(6e-4, ge=0)
    """Muon's peak learning rate (the matrices'), reached at the end of warmup. Levanter's default
    is kept; Muon usually wants far more, e.g. 0.02 (or about AdamW's with
    ``use_kimi_scaling``)."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay, scaled by the learning rate of the part it is in (Muon's or
    AdamW's), on the parameters ``weight_decay_modules`` / ``default_weight_decay_mask`` select.
    0 turns it off."""
    lr: float = 0.02
    """No effect (as in Levanter, where it is left over): ``learning_rate`` is Muon's learning
    rate. Setting it gives a warning."""
    adam_lr: float = Field(6e-4, ge=0)
    """AdamW's peak learning rate, for the parameters that are not hidden weight matrices
    (embeddings, LM head, norms, biases); the schedule has the same shape as ``learning_rate``'s."""
    momentum: float = Field(0.95, ge=0, lt=1)
    """Decay of Muon's momentum ``B <- momentum B + G`` (a sum of gradients, not an average)."""
    nesterov: bool = True
    """Orthogonalize Nesterov's look-ahead ``momentum B + G`` rather than ``B`` itself."""
    backend_steps: int = Field(5, ge=1)
    """Number of Newton-Schulz iterations that orthogonalize each matrix's momentum."""
    muon_epsilon: float = Field(1e-8, gt=0)
    """Added to each matrix's Frobenius norm before dividing by it, ahead of the Newton-Schulz
    iterations (keeps an all-zero matrix at zero)."""
    use_kimi_scaling: bool = False
    """Scale each orthogonalized update by ``0.2 * sqrt(max(d_out, d_in))`` (Moonshot's "Muon is
    Scalable": the update then has AdamW's typical RMS, so AdamW's learning rate and weight decay
    carry over) instead of ``sqrt(max(1, d_out / d_in))`` (Keller Jordan's)."""
    beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW's decay rate of the running mean of gradients."""
    beta2: float = Field(0.95, ge=0, lt=1)
    """AdamW's decay rate of the running mean of squared gradients."""
    epsilon: float = Field(1e-8, ge=0)
    """AdamW's epsilon, added to the root of the second moment."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the gradients of AdamW's parameters so that their global L2 norm is at most this
    (Muon's are not clipped: orthogonalization discards their scale). None turns clipping off."""

    @model_validator(mode="after")
    def _warn_unused_lr(self):
        if "lr" in self.model_fields_set:
            warnings.warn(
                f"optimizer.lr ({self.lr}) has no effect (as in Levanter): Muon's learning rate is "
                "optimizer.learning_rate and AdamW's is optimizer.adam_lr",
                UserWarning,
                stacklevel=2,
            )
        return self

    def build(self, num_train_steps: int) -> optax.GradientTransformation:
        """Muon on the hidden weight matrices, AdamW on the rest (``optax.partition``)."""
        muon = scale_by_muon(self.momentum, self.nesterov, self.backend_steps, self.muon_epsilon, self.use_kimi_scaling)
        return matrices_and_adamw(
            self, muon, num_train_steps, label="muon", adam_lr=self.adam_lr, adam_weight_decay=self.weight_decay,
            beta1=self.beta1, beta2=self.beta2, epsilon=self.epsilon, max_grad_norm=self.max_grad_norm,
        )  # fmt: skip
