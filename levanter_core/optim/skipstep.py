"""``optimizer.skip_bad_steps``: skip an update whose loss or gradient norm is far out of line.

A loss spike or a gradient blow-up can undo hours of training in one step. The
skip-step wrapper keeps the losses and gradient norms of the last
``rolling_interval_length`` steps in the optimizer state (so they are checkpointed
and survive a resume) and refuses a step whose loss or gradient norm exceeds the
window's mean by more than ``sigma_factor`` standard deviations: the parameters do
not move and the wrapped optimizer's state does not change. The idea is OLMo-core's
``SkipStepOptimizer``, as Levanter's ``SkipStepConfig`` exposes it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from pydantic import Field

from levanter_core.config.base import ConfigModel


class SkipStepConfig(ConfigModel):
    """When to skip a step: the size of the rolling window of past steps and how far out of
    line (in standard deviations) a step's loss or gradient norm must be to be skipped."""

    rolling_interval_length: int = Field(128, ge=2)
    """How many past steps the window holds. Steps are never skipped until at least
    ``max(2, rolling_interval_length // 2)`` of them have been recorded."""
    sigma_factor: float = Field(6.0, gt=0)
    """A step is skipped when its loss or gradient norm is above the window's mean plus this
    many (sample) standard deviations."""

    @property
    def min_history(self) -> int:
        """How many recorded steps the window needs before it may skip one."""
        return max(2, self.rolling_interval_length // 2)

    def wrap(self, inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
        """``inner`` with skip-step logic around it; see :func:`skip_bad_steps`."""
        return skip_bad_steps(inner, self)


def skip_step_section(value: Any) -> Any:
    """What ``optimizer.skip_bad_steps`` accepts, as Levanter's guide writes it: false or null
    (off), true (the defaults), a number (the window length) or a section. Returns None or
    what pydantic validates into a :class:`SkipStepConfig`."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, int):
        return {"rolling_interval_length": value}
    if isinstance(value, (dict, SkipStepConfig)):
        return value
    raise ValueError(
        "expected false, true, a window length, or a section "
        f"{{rolling_interval_length: 128, sigma_factor: 6.0}}; got {value!r}"
    )


class SkipStepState(NamedTuple):
    """The wrapped optimizer's state, the rolling window of recent steps, and how many steps
    have been skipped since the start of training.

    The window (``losses``, ``grad_norms``) is a ring buffer: the values of the ``n``-th
    recorded step (from 0) are at ``n % rolling_interval_length``; ``recorded`` counts every
    step recorded so far.
    """

    inner_state: optax.OptState
    losses: jax.Array
    grad_norms: jax.Array
    recorded: jax.Array
    skipped: jax.Array


def skip_bad_steps(
    inner: optax.GradientTransformation, config: SkipStepConfig
) -> optax.GradientTransformationExtraArgs:
    """Wrap ``inner`` so that ``update(grads, state, params, loss=...)`` skips bad steps.

    A step is skipped (zero updates, ``inner``'s state kept as it was) when the window holds
    at least ``config.min_history`` steps and the step's loss or global gradient norm is above
    the window's mean plus ``config.sigma_factor`` standard deviations. A step whose loss or
    gradient norm is NaN or infinite is always skipped and never recorded, because one such
    value in the window would make every later threshold NaN. Every other step's values enter
    the window after the decision, skipped or not. ``loss`` is required.
    """
    length = config.rolling_interval_length
    inner = optax.with_extra_args_support(inner)

    def init(params):
        window = jnp.zeros((length,), jnp.float32)
        zero = jnp.zeros((), jnp.int32)
        return SkipStepState(inner.init(params), window, window, zero, zero)

    def update(updates, state: SkipStepState, params=None, *, loss=None, **extra_args):
        if loss is None:
            raise ValueError(
                "optimizer.skip_bad_steps needs the loss of each step: call update(grads, state, params, loss=loss)"
            )
        loss = jnp.asarray(loss, jnp.float32)
        grad_norm = optax.global_norm(updates).astype(jnp.float32)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        out_of_line = _above_window(state.losses, loss, state.recorded, config) | _above_window(
            state.grad_norms, grad_norm, state.recorded, config
        )
        skip = ~finite | out_of_line

        new_updates, new_inner = inner.update(updates, state.inner_state, params, loss=loss, **extra_args)
        new_updates = jax.tree.map(lambda u: jnp.where(skip, jnp.zeros_like(u), u), new_updates)
        new_inner = jax.tree.map(lambda new, old: jnp.where(skip, old, new), new_inner, state.inner_state)

        slot = state.recorded % length
        return new_updates, SkipStepState(
            inner_state=new_inner,
            losses=jnp.where(finite, state.losses.at[slot].set(loss), state.losses),
            grad_norms=jnp.where(finite, state.grad_norms.at[slot].set(grad_norm), state.grad_norms),
            recorded=state.recorded + finite.astype(jnp.int32),
            skipped=state.skipped + skip.astype(jnp.int32),
        )

    return optax.GradientTransformationExtraArgs(init, update)


def _above_window(window: jax.Array, value: jax.Array, recorded: jax.Array, config: SkipStepConfig) -> jax.Array:
    """True when the window is full enough and ``value`` exceeds its mean + sigma * std."""
    count = jnp.minimum(recorded, config.rolling_interval_length)
    valid = jnp.arange(window.shape[0]) < count
    n = jnp.maximum(count, 2).astype(jnp.float32)  # guards the division; unused below min_history
    mean = jnp.sum(jnp.where(valid, window, 0.0)) / n
    variance = jnp.sum(jnp.where(valid, (window - mean) ** 2, 0.0)) / (n - 1)
    threshold = mean + config.sigma_factor * jnp.sqrt(variance)
    return (count >= config.min_history) & (value > threshold)


def skipped_step(before: Any, after: Any) -> jax.Array | None:
    """1 if the update that turned optimizer state ``before`` into ``after`` was skipped, else 0;
    None when the optimizer does not skip steps (it has no :class:`SkipStepState`)."""
    old, new = _find_skip_state(before), _find_skip_state(after)
    if old is None or new is None:
        return None
    return new.skipped - old.skipped


def _find_skip_state(opt_state: Any) -> SkipStepState | None:
    is_skip_state = lambda x: isinstance(x, SkipStepState)
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=is_skip_state) if is_skip_state(s)]
    return found[0] if found else None
