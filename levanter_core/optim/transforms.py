"""Optax transformations shared by the built-in optimizers.

- :func:`log_global_norm`: log the global norm of the update passing through, unchanged.
- :func:`scan_aware_clip_by_block_rms`: clip each parameter's update to an RMS bound (as in
  Adafactor and StableAdamW), each layer of a stack of layers on its own.
- :func:`clip_update_by_historical_norm` (``optimizer.clip_update_norm``, configured by
  :class:`ClipUpdateNormConfig`): clip the update's global norm to what recent steps make
  plausible.
- :func:`decoupled_weight_decay`: AdamW's weight decay, optionally AdamC's.
- :func:`cautious`: the cautious mask (Liang et al. 2024) on another transformation's update.

Everything here works under ``jit`` and keeps its state as arrays, so it is checkpointed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import haliax as hax
import jax
import jax.numpy as jnp
import optax
from haliax.tree_util import scan_aware_tree_map
from pydantic import Field

from levanter_core.config.base import ConfigModel
from levanter_core.tracker.jit_log import jit_log

PyTree = Any

# Levanter's metric names, so dashboards built for Levanter runs keep working.
PRE_CLIP_UPDATE_NORM = "optim/pre_clip_update_norm"
POST_CLIP_UPDATE_NORM = "optim/post_clip_update_norm"


def log_global_norm(name: str) -> optax.GradientTransformation:
    """A transformation that leaves the update as it is and logs its global L2 norm as
    ``name`` (with :func:`levanter_core.tracker.jit_log`, so it reaches the trackers with the
    step's other metrics)."""

    def update(updates, state, params=None):
        del params
        jit_log({name: optax.global_norm(updates)})
        return updates, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def scan_aware_clip_by_block_rms(threshold: float) -> optax.GradientTransformation:
    """Scale each parameter's update down, when needed, so that its root mean square is at most
    ``threshold`` (``u / max(1, rms(u) / threshold)``; a smaller update is left alone).

    Layers stacked with ``haliax.nn.Stacked`` hold one array per parameter for all layers; each
    layer's slice of it is clipped on its own RMS, as if the layers were separate parameters,
    so one layer's large update does not shrink the others'.
    """
    if not threshold > 0:
        raise ValueError(f"the RMS clipping threshold must be positive, got {threshold}")

    def clip(u):
        raw = u.array if hax.is_named_array(u) else u
        rms = jnp.sqrt(jnp.mean(jnp.square(raw.astype(jnp.float32))))
        divisor = jnp.maximum(1.0, rms / threshold)
        return u / divisor.astype(raw.dtype)

    def update(updates, state, params=None):
        del params
        return scan_aware_tree_map(clip, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


class ClipUpdateNormConfig(ConfigModel):
    """``optimizer.clip_update_norm``: clip the global norm of each update to the mean plus
    ``sigma_factor`` standard deviations of the (unclipped) norms of the last
    ``rolling_interval_length`` updates. A gentler guard against spikes than
    ``skip_bad_steps``: the step is taken, only shortened."""

    rolling_interval_length: int = Field(128, ge=2)
    """How many past update norms the window holds. Nothing is clipped until it holds at least
    ``max(2, rolling_interval_length // 2)`` of them."""
    sigma_factor: float = Field(3.0, gt=0)
    """An update whose norm is above the window's mean plus this many (population) standard
    deviations is scaled down to that norm."""

    def build(self) -> optax.GradientTransformation:
        """The transformation; see :func:`clip_update_by_historical_norm`."""
        return clip_update_by_historical_norm(self.rolling_interval_length, self.sigma_factor)


class ClipUpdateNormState(NamedTuple):
    """The window of recent update norms, a ring buffer: the ``n``-th recorded norm (from 0) is
    at ``n % len(norms)``; ``recorded`` counts the norms recorded so far."""

    norms: jax.Array
    recorded: jax.Array


def clip_update_by_historical_norm(
    rolling_interval_length: int = 128, sigma_factor: float = 3.0
) -> optax.GradientTransformation:
    """Clip the update's global norm to ``mean + sigma_factor * std`` of the window of the last
    ``rolling_interval_length`` unclipped norms (the standard deviation floored at 1e-6), once
    the window holds at least ``max(2, rolling_interval_length // 2)`` norms.

    The window records the norm before clipping, so that a run of clipped steps cannot pull
    the threshold down with it. A non-finite norm is not recorded: one would make every later
    threshold NaN, and so turn the clipping off for good. Logs ``optim/clip_update/did_clip``,
    ``pre_clip_norm``, ``post_clip_norm`` and ``update_norm_threshold`` (the window's bound,
    also before it is in force).
    """
    if rolling_interval_length < 2:
        raise ValueError(f"rolling_interval_length must be at least 2, got {rolling_interval_length}")
    if not sigma_factor > 0:
        raise ValueError(f"sigma_factor must be positive, got {sigma_factor}")
    length = rolling_interval_length
    min_history = max(2, length // 2)

    def init(params):
        del params
        return ClipUpdateNormState(jnp.zeros((length,), jnp.float32), jnp.zeros((), jnp.int32))

    def update(updates, state: ClipUpdateNormState, params=None):
        del params
        norm = optax.global_norm(updates).astype(jnp.float32)
        count = jnp.minimum(state.recorded, length)
        valid = jnp.arange(length) < count
        n = jnp.maximum(count, 1).astype(jnp.float32)  # guards the division; unused below min_history
        mean = jnp.sum(jnp.where(valid, state.norms, 0.0)) / n
        std = jnp.sqrt(jnp.sum(jnp.where(valid, (state.norms - mean) ** 2, 0.0)) / n)
        threshold = mean + sigma_factor * jnp.maximum(std, 1e-6)
        max_norm = jnp.where(count >= min_history, threshold, jnp.inf)
        scale = jnp.where(norm > max_norm, max_norm / jnp.maximum(norm, 1e-6), 1.0)
        clipped = jax.tree.map(lambda u: u * scale.astype(u.dtype), updates)

        jit_log(
            {
                "optim/clip_update/did_clip": (scale < 1.0).astype(jnp.float32),
                "optim/clip_update/pre_clip_norm": norm,
                "optim/clip_update/update_norm_threshold": threshold,
                "optim/clip_update/post_clip_norm": jnp.minimum(max_norm, norm),
            }
        )

        finite = jnp.isfinite(norm)
        slot = state.recorded % length
        return clipped, ClipUpdateNormState(
            norms=jnp.where(finite, state.norms.at[slot].set(norm), state.norms),
            recorded=state.recorded + finite.astype(jnp.int32),
        )

    return optax.GradientTransformation(init, update)


def decoupled_weight_decay(
    weight_decay: float,
    mask: Callable[[PyTree], PyTree] | None,
    *,
    adamc: bool = False,
    lr_schedule: optax.Schedule | None = None,
    peak_lr: float | None = None,
) -> optax.GradientTransformation:
    """Add ``weight_decay * param`` to the update of each parameter ``mask`` selects (all when
    None), before the learning-rate scaling, as AdamW does.

    With ``adamc``, the decay of step ``t`` is ``weight_decay * lr_schedule(t) / peak_lr``
    (AdamC, Defazio 2025, "On the Correct Treatment of Weight Decay in Adam"): the update then
    decays by ``weight_decay * lr_t**2 / peak_lr``, so the balance between decay and learning
    rate holds as the learning rate falls.
    """
    if not adamc:
        return optax.add_decayed_weights(weight_decay, mask)
    if lr_schedule is None or peak_lr is None:
        raise ValueError("AdamC weight decay needs the learning-rate schedule and its peak")
    # With a peak of 0 every step is 0 and the decay does not matter.
    ratio = weight_decay / peak_lr if peak_lr > 0 else 0.0

    def schedule(count):
        return ratio * lr_schedule(count)

    return optax.add_decayed_weights(schedule, mask)


def cautious(inner: optax.GradientTransformation, eps: float) -> optax.GradientTransformation:
    """``inner`` with the cautious mask (Liang et al. 2024, "Cautious Optimizers",
    https://arxiv.org/abs/2411.16085): each coordinate of ``inner``'s update whose sign
    disagrees with the incoming gradient's (or where either is 0) is set to 0, and the rest
    are scaled by ``1 / (mean(mask) + eps)``, the mean taken over each whole parameter (a
    stacked parameter's layers together), to keep the update's size."""

    def update(updates, state, params=None):
        new_updates, new_state = inner.update(updates, state, params)

        def mask(u, g):
            keep = (u * g > 0).astype(u.dtype)
            rescale = 1.0 / (jnp.mean(keep, dtype=jnp.float32) + eps)
            return u * keep * rescale.astype(u.dtype)

        return jax.tree.map(mask, new_updates, updates), new_state

    return optax.GradientTransformation(inner.init, update)
