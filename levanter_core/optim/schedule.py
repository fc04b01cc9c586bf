"""The learning-rate schedule: warmup, stable and decay phases, in one or more cycles.

Training is split into cycles (one by default). Each cycle runs::

    [(re)warmup] -> [stable] -> [decay]

* the first cycle warms up linearly from 0 to the peak learning rate; later
  cycles re-warm linearly from the previous cycle's final value back to the peak
  (a re-warmup of 0 steps jumps straight back to the peak);
* the stable phase holds the peak;
* the decay phase brings the rate down to ``min_lr_ratio * peak``, reached
  exactly at the cycle's last boundary (the first step of the next cycle, or
  ``num_train_steps``).

Phase lengths are given as a fraction of the cycle (a float below 1) or as a
number of steps. Everything is plain ``jnp`` arithmetic on the step, so a
schedule can be called with a Python int on the host or with a traced step
inside ``jit``.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Literal

import jax
import jax.numpy as jnp
import optax

DecayShape = Literal["constant", "linear", "cosine", "inv_sqrt", "inv"]


def to_steps(value: int | float, total: int, *, one_is_fraction: bool = False) -> int:
    """A phase length in steps: a float below 1 is a fraction of ``total`` (rounded to
    the nearest step), anything else is a number of steps. With ``one_is_fraction``,
    the float ``1.0`` also counts as a fraction (all of ``total``)."""
    if isinstance(value, float) and (value < 1 or (one_is_fraction and value == 1)):
        return round(value * total)
    return int(value)


def cycle_ends(
    num_train_steps: int,
    *,
    cycles: int | list[int] | None = None,
    cycle_length: int | float | list[int] | None = None,
) -> list[int]:
    """The step at which each cycle ends, in order; the last is always ``num_train_steps``.

    * ``cycles`` as an int: that many cycles of (nearly) equal length;
    * ``cycles`` as a list: the steps where cycles end (a leading 0 is ignored,
      ``num_train_steps`` is added if missing);
    * ``cycle_length`` as a number: cycles of that many steps (a float up to 1 is a
      fraction of the run); steps left over join the last cycle;
    * ``cycle_length`` as a list: the length of each cycle; steps left over form one
      more cycle.
    """
    if num_train_steps < 1:
        raise ValueError(f"num_train_steps must be at least 1, got {num_train_steps}")
    if cycles is not None and cycle_length is not None:
        raise ValueError("It is an error to specify both `cycles` and `cycle_length`; use one of them")

    given = f"cycles={cycles!r}" if cycles is not None else f"cycle_length={cycle_length!r}"
    if isinstance(cycles, int):
        ends = [round(num_train_steps * i / cycles) for i in range(1, cycles + 1)]
    elif isinstance(cycles, list):
        # The guide counts step 0 among the minima too; accept it written out.
        ends = cycles[1:] if cycles[:1] == [0] else list(cycles)
    elif isinstance(cycle_length, list):
        ends = list(itertools.accumulate(cycle_length))
    elif cycle_length is not None:
        length = to_steps(cycle_length, num_train_steps, one_is_fraction=True)
        if not 1 <= length <= num_train_steps:
            raise ValueError(
                f"{given} is {length} steps, but a cycle must be between 1 step "
                f"and the whole run ({num_train_steps} steps)"
            )
        ends = [length * i for i in range(1, num_train_steps // length)]
    else:
        return [num_train_steps]

    if ends and ends[-1] > num_train_steps:
        raise ValueError(
            f"{given} reaches step {ends[-1]}, past the end of training (num_train_steps={num_train_steps})"
        )
    if not ends or ends[-1] != num_train_steps:
        ends.append(num_train_steps)
    starts = [0] + ends[:-1]
    for i, (start, end) in enumerate(zip(starts, ends)):
        if end <= start:
            raise ValueError(
                f"{given} with num_train_steps={num_train_steps} makes cycle {i + 1} empty "
                f"(steps {start} to {end}); use fewer or longer cycles"
            )
    return ends


def decay_curve(shape: DecayShape, peak: float, min_lr_ratio: float) -> Callable[[jax.Array], jax.Array]:
    """The decay phase as a function of its progress ``p`` (0 at its start, 1 at its end).

    Every shape starts at ``peak`` and, except ``constant``, ends exactly at
    ``min_lr_ratio * peak``:

    * ``linear``: a straight line;
    * ``cosine``: half a cosine wave;
    * ``inv_sqrt``: ``peak / sqrt(1 + k p)`` with ``k = 1/min_lr_ratio**2 - 1``;
    * ``inv``: ``peak / (1 + k p)`` with ``k = 1/min_lr_ratio - 1``.

    ``inv_sqrt`` and ``inv`` keep their true shape and choose their timescale
    ``k`` so the curve lands on the minimum; they never reach 0, so they need
    ``min_lr_ratio > 0``.
    """
    floor = peak * min_lr_ratio
    if shape in ("inv_sqrt", "inv") and min_lr_ratio <= 0:
        raise ValueError(f"lr_schedule {shape!r} never reaches 0: set min_lr_ratio above 0")
    match shape:
        case "constant":
            return lambda p: jnp.full_like(p, peak)
        case "linear":
            return lambda p: peak + (floor - peak) * p
        case "cosine":
            return lambda p: floor + (peak - floor) * 0.5 * (1 + jnp.cos(math.pi * p))
        case "inv_sqrt":
            k = 1 / min_lr_ratio**2 - 1
            return lambda p: peak * jax.lax.rsqrt(1 + k * p)
        case "inv":
            k = 1 / min_lr_ratio - 1
            return lambda p: peak / (1 + k * p)
    raise ValueError(f"unknown lr_schedule {shape!r}; expected one of constant, linear, cosine, inv_sqrt, inv")


def _cycle(
    start_lr: float, peak: float, ramp: int, decay_start: int, decay_steps: int, curve: Callable
) -> optax.Schedule:
    """One cycle, as a function of the step counted from the cycle's start."""

    def lr(step):
        t = jnp.asarray(step, jnp.float32)
        ramped = start_lr + (peak - start_lr) * t / max(ramp, 1)
        # Before decay_start the progress clips to 0 (the stable phase at the peak);
        # past the end it clips to 1 (the minimum).
        decayed = curve(jnp.clip(t - decay_start, 0, decay_steps) / max(decay_steps, 1))
        return jnp.where(t < ramp, ramped, decayed)

    return lr


def learning_rate_schedule(
    *,
    learning_rate: float,
    num_train_steps: int,
    min_lr_ratio: float = 0.1,
    warmup: int | float = 0.01,
    decay: int | float | None = None,
    rewarmup: int | float = 0.0,
    cycles: int | list[int] | None = None,
    cycle_length: int | float | list[int] | None = None,
    shape: DecayShape = "cosine",
) -> optax.Schedule:
    """``step -> learning rate`` for the whole run (see the module docstring).

    ``warmup`` applies to the first cycle, ``rewarmup`` to the others; both, and
    ``decay``, are fractions of each cycle's length or numbers of steps. ``decay``
    of ``None`` decays over everything after the (re)warmup, leaving no stable
    phase. Raises ``ValueError`` when the phases do not fit in a cycle.
    """
    curve = decay_curve(shape, learning_rate, min_lr_ratio)
    ends = cycle_ends(num_train_steps, cycles=cycles, cycle_length=cycle_length)
    starts = [0] + ends[:-1]

    pieces = []
    start_lr = 0.0
    for i, (start, end) in enumerate(zip(starts, ends)):
        length = end - start
        ramp_field, ramp_value = ("warmup", warmup) if i == 0 else ("rewarmup", rewarmup)
        ramp = to_steps(ramp_value, length)
        decay_steps = length - ramp if decay is None else to_steps(decay, length)
        if ramp + decay_steps > length:
            what = f"{ramp_field} ({ramp} steps)"
            if decay is not None:
                what += f" plus decay ({decay_steps} steps)"
            raise ValueError(
                f"cycle {i + 1} of {len(ends)} (steps {start} to {end}) is {length} steps long, "
                f"too short for {what}; shorten the phases or use longer cycles"
            )
        piece = _cycle(start_lr, learning_rate, ramp, length - decay_steps, decay_steps, curve)
        pieces.append(piece)
        start_lr = float(piece(length))

    if len(pieces) == 1:
        return pieces[0]
    return optax.join_schedules(pieces, starts[1:])
