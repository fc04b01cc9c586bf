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

The decay phase's shape is an ``lr_schedule`` section (:data:`LrSchedule`): one of the
classes below, chosen by ``type``, or just its name (``cosine``) for the shape with its
default fields. The shape only decides the decay phase; warmup, the stable phase and the
cycles are the same for every shape.
"""

from __future__ import annotations

import abc
import itertools
import math
from collections.abc import Callable
from typing import Annotated, Any, Literal

import jax
import jax.numpy as jnp
import optax
from pydantic import BeforeValidator, Field, PlainSerializer

from levanter_core.config.base import ConfigModel

DecayShape = Literal["constant", "linear", "cosine", "inv_sqrt", "inv"]
"""The shapes that may be written as a plain name (``power`` needs its fields)."""

Curve = Callable[[jax.Array], jax.Array]
"""The decay phase: float32 steps since its start (clipped to its length) -> learning rate."""


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


class LrScheduleSection(ConfigModel, abc.ABC):
    """Base of the ``lr_schedule`` sections: the shape of the decay phase.

    A section equals the plain name that stands for it (``CosineSchedule() == "cosine"``),
    so code that compared ``lr_schedule`` with a name, from when the field held only names,
    keeps working; it is written back as that name too.
    """

    type: str
    """The shape's name."""

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            named = _named_section(other)
            return named is not None and super().__eq__(named)
        return super().__eq__(other)

    def __hash__(self) -> int:
        # Equal sections (and a section and its name) have the same type, hence the same hash.
        return hash(self.type)

    @abc.abstractmethod
    def curve(self, peak: float, min_lr_ratio: float, decay_steps: int) -> Curve:
        """The decay phase of ``decay_steps`` steps from ``peak``, towards ``min_lr_ratio * peak``,
        as a function of the (float32) steps since its start, clipped to ``[0, decay_steps]``."""

    def check(self, min_lr_ratio: float) -> None:
        """Raise ``ValueError`` if this shape cannot work with ``min_lr_ratio``."""


def _progress(t: jax.Array, decay_steps: int) -> jax.Array:
    """How far through the decay phase ``t`` is: 0 at its start, 1 at its end."""
    return t / max(decay_steps, 1)


class ConstantSchedule(LrScheduleSection):
    """No decay: the decay phase stays at the peak learning rate."""

    type: Literal["constant"] = "constant"

    def curve(self, peak: float, min_lr_ratio: float, decay_steps: int) -> Curve:
        return lambda t: jnp.full_like(t, peak)


class LinearSchedule(LrScheduleSection):
    """A straight line from the peak to the minimum."""

    type: Literal["linear"] = "linear"

    def curve(self, peak: float, min_lr_ratio: float, decay_steps: int) -> Curve:
        floor = peak * min_lr_ratio
        return lambda t: peak + (floor - peak) * _progress(t, decay_steps)


class CosineSchedule(LrScheduleSection):
    """Half a cosine wave from the peak to the minimum: ``min + (peak - min) * c**exponent``
    with ``c = (1 + cos(pi p)) / 2`` at progress ``p`` through the decay (as
    ``optax.cosine_decay_schedule``)."""

    type: Literal["cosine"] = "cosine"
    exponent: float = Field(1.0, gt=0)
    """Power the cosine factor (1 at the start of the decay, 0 at its end) is raised to, as
    ``optax.cosine_decay_schedule``'s ``exponent``: above 1 falls faster at first and stays
    longer near the minimum, below 1 stays longer near the peak. 1 is the plain cosine."""

    def curve(self, peak: float, min_lr_ratio: float, decay_steps: int) -> Curve:
        floor = peak * min_lr_ratio
        if self.exponent == 1:
            # Kept exactly as the plain cosine has always been computed (bit for bit).
            return lambda t: floor + (peak - floor) * 0.5 * (1 + jnp.cos(math.pi * _progress(t, decay_steps)))
        exponent = self.exponent
        return lambda t: floor + (peak - floor) * (0.5 * (1 + jnp.cos(math.pi * _progress(t, decay_steps)))) ** exponent


class InvSqrtSchedule(LrScheduleSection):
    """``1/sqrt`` decay: ``peak / sqrt(1 + t / timescale)`` at ``t`` steps into the decay.

    Without ``timescale`` it is chosen so that the curve lands exactly on the minimum at the end
    of the decay (``timescale = decay steps * min_lr_ratio**2 / (1 - min_lr_ratio**2)``), which
    needs ``min_lr_ratio > 0``. With a ``timescale`` the curve keeps that rate of fall whatever
    the decay's length and stops at the minimum learning rate once it reaches it.

    Levanter's ``inv_sqrt`` is ``peak * min(1, sqrt(timescale / s))`` floored at the minimum,
    with ``s`` the steps into the decay phase plus the cycle's (re)warmup steps: flat at the
    peak up to ``s = timescale``, then a sharp bend into ``1/sqrt``. Here the decay starts
    smoothly where the decay phase does, and approaches the same ``peak * sqrt(timescale / t)``
    once ``t`` is well past ``timescale``.
    """

    type: Literal["inv_sqrt"] = "inv_sqrt"
    timescale: float | None = Field(None, gt=0)
    """Steps into the decay phase at which the learning rate is ``peak / sqrt(2)``; it falls as
    ``1/sqrt`` of the steps after that. None (the default; Levanter's is 10000): chosen so
    that the decay ends exactly at ``min_lr_ratio * learning_rate``."""

    def check(self, min_lr_ratio: float) -> None:
        if self.timescale is None and min_lr_ratio <= 0:
            raise ValueError(
                "lr_schedule 'inv_sqrt' never reaches 0: set min_lr_ratio above 0, or give the "
                "lr_schedule section a timescale"
            )

    def curve(self, peak: float, min_lr_ratio: float, decay_steps: int) -> Curve:
        self.check(min_lr_ratio)
        if self.timescale is None:
            k = 1 / min_lr_ratio**2 - 1
            return lambda t: peak * jax.lax.rsqrt(1 + k * _progress(t, decay_steps))
        floor, timescale = peak * min_lr_ratio, self.timescale
        return lambda t: jnp.maximum(floor, peak * jax.lax.rsqrt(1 + t / timescale))


class InvSchedule(LrScheduleSection):
    """``1/x`` decay: ``peak / (1 + k p)`` at progress ``p`` through the decay, with
    ``k = 1/min_lr_ratio - 1`` so that it ends exactly at the minimum (as in Levanter);
    needs ``min_lr_ratio > 0``."""

    type: Literal["inv"] = "inv"

    def check(self, min_lr_ratio: float) -> None:
        if min_lr_ratio <= 0:
            raise ValueError("lr_schedule 'inv' never reaches 0: set min_lr_ratio above 0")

    def curve(self, peak: float, min_lr_ratio: float, decay_steps: int) -> Curve:
        self.check(min_lr_ratio)
        k = 1 / min_lr_ratio - 1
        return lambda t: peak / (1 + k * _progress(t, decay_steps))


class PowerSchedule(LrScheduleSection):
    """The Power Scheduler (Shen et al. 2024, "Power Scheduler: A Batch Size and Token Number
    Agnostic Learning Rate Scheduler"): ``min(peak, batch_size * a * tokens**b)``, with
    ``tokens = t * batch_size * seq_length`` the tokens trained in the ``t`` steps since the
    start of the decay phase. The paper tunes ``a`` and ``b`` for models in maximal update
    parametrization (muP).

    As in Levanter, ``min_lr_ratio`` does not apply: the rate follows the power law down to
    wherever it is at the end of the decay. Unlike Levanter, the token count is a float, so it
    does not overflow (Levanter multiplies in int32, which wraps past 2**31 tokens)."""

    type: Literal["power"] = "power"
    batch_size: int = Field(ge=1)
    """Sequences per step (normally ``trainer.train_batch_size``), for the tokens trained so
    far; also the ``batch_size`` factor of the formula. Required."""
    seq_length: int = Field(ge=1)
    """Tokens per sequence (normally the model's ``seq_len``), for the tokens trained so far.
    Required."""
    a: float = Field(4.6, gt=0)
    """The amplitude of the power law; must be positive."""
    b: float = Field(-0.51, lt=0)
    """The exponent of the power law in the tokens trained; must be negative."""

    def curve(self, peak: float, min_lr_ratio: float, decay_steps: int) -> Curve:
        tokens_per_step = float(self.batch_size * self.seq_length)
        scale, b = self.batch_size * self.a, self.b

        def lr(t):
            # At t = 0 the power is inf, so the rate starts at the peak.
            return jnp.minimum(peak, scale * (t * tokens_per_step) ** b)

        return lr


_SECTIONS: dict[str, type[LrScheduleSection]] = {
    cls.model_fields["type"].default: cls
    for cls in (ConstantSchedule, LinearSchedule, CosineSchedule, InvSqrtSchedule, InvSchedule, PowerSchedule)
}
_NAMES = ", ".join(_SECTIONS)


def _named_section(name: str) -> LrScheduleSection | None:
    """The section a plain name stands for (its default fields), or None if there is none."""
    cls = _SECTIONS.get(name)
    if cls is None or any(field.is_required() for field in cls.model_fields.values()):
        return None
    return cls.model_validate({})  # every field has a default (the base class's `type` included)


def lr_schedule_section(value: Any) -> LrScheduleSection:
    """What ``optimizer.lr_schedule`` accepts: a shape's name (``cosine``), or a section with
    ``type`` and that shape's fields (``{type: cosine, exponent: 2}``), or a section object.
    Returns the section; raises ``ValueError`` (or pydantic's ``ValidationError`` for a bad
    field) otherwise."""
    if isinstance(value, LrScheduleSection):
        return value
    if isinstance(value, str):
        if value not in _SECTIONS:
            raise ValueError(f"unknown lr_schedule {value!r}; expected one of {_NAMES}")
        value = {"type": value}
    if not isinstance(value, dict):
        raise ValueError(f"expected a shape name ({_NAMES}) or a section with a `type`")
    name = value.get("type")
    if name is None:
        raise ValueError(f"an lr_schedule section needs a `type`: one of {_NAMES}")
    if name not in _SECTIONS:
        raise ValueError(f"unknown lr_schedule type {name!r}; expected one of {_NAMES}")
    return _SECTIONS[name].model_validate(value)


def _as_written(section: LrScheduleSection) -> Any:
    """A section with its default fields is written as its name, as before sections existed."""
    return section.type if section == section.type else section.model_dump(mode="json")


LrSchedule = Annotated[
    ConstantSchedule | LinearSchedule | CosineSchedule | InvSqrtSchedule | InvSchedule | PowerSchedule,
    Field(discriminator="type"),
    BeforeValidator(lr_schedule_section),
    PlainSerializer(_as_written),
]
"""The type of ``optimizer.lr_schedule``: a name or a section, always held as a section."""


def decay_curve(shape: DecayShape | LrScheduleSection, peak: float, min_lr_ratio: float, decay_steps: int) -> Curve:
    """The decay phase of ``decay_steps`` steps for ``shape`` (a name or a section), as a
    function of the steps since its start (see :meth:`LrScheduleSection.curve`).

    Every shape starts at ``peak``; ``linear``, ``cosine``, ``inv`` and ``inv_sqrt`` without
    a ``timescale`` end exactly at ``min_lr_ratio * peak``; ``constant`` stays at the peak;
    ``power`` and ``inv_sqrt`` with a ``timescale`` follow their own law (the latter floored at
    the minimum)."""
    section = lr_schedule_section(shape)
    section.check(min_lr_ratio)
    return section.curve(peak, min_lr_ratio, decay_steps)


def _cycle(start_lr: float, peak: float, ramp: int, decay_start: int, decay_steps: int, curve: Curve) -> optax.Schedule:
    """One cycle, as a function of the step counted from the cycle's start."""

    def lr(step):
        t = jnp.asarray(step, jnp.float32)
        ramped = start_lr + (peak - start_lr) * t / max(ramp, 1)
        # Before decay_start the decay's clock clips to 0 (the stable phase at the peak);
        # past the end it clips to the decay's length (its final value).
        decayed = curve(jnp.clip(t - decay_start, 0, decay_steps))
        return jnp.where(t < ramp, ramped, decayed)

    return lr


class PhaseError(ValueError):
    """Phases of the schedule that do not fit the run; ``field`` is the optimizer field to change."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def schedule_phases(
    num_train_steps: int,
    *,
    warmup: int | float = 0.01,
    decay: int | float | None = None,
    rewarmup: int | float = 0.0,
    cycles: int | list[int] | None = None,
    cycle_length: int | float | list[int] | None = None,
) -> list[tuple[int, int, int, int]]:
    """``(start, end, ramp steps, decay steps)`` of each cycle of the schedule, worked out
    without building it (no JAX). Raises :class:`PhaseError` naming the field when the cycles
    or their phases do not fit in the run."""
    try:
        ends = cycle_ends(num_train_steps, cycles=cycles, cycle_length=cycle_length)
    except ValueError as e:
        raise PhaseError(str(e), "cycles" if cycles is not None else "cycle_length") from None
    phases = []
    for i, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
        length = end - start
        ramp_field, ramp_value = ("warmup", warmup) if i == 0 else ("rewarmup", rewarmup)
        ramp = to_steps(ramp_value, length)
        decay_steps = length - ramp if decay is None else to_steps(decay, length)
        if ramp > length or ramp + decay_steps > length:
            what = f"{ramp_field} ({ramp} steps)"
            if decay is not None and ramp <= length:
                what += f" plus decay ({decay_steps} steps)"
            raise PhaseError(
                f"cycle {i + 1} of {len(ends)} (steps {start} to {end}) is {length} steps long, "
                f"too short for {what}; shorten the phases or use longer cycles",
                ramp_field if ramp > length or decay is None else "decay",
            )
        phases.append((start, end, ramp, decay_steps))
    return phases


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
    shape: DecayShape | LrScheduleSection = "cosine",
) -> optax.Schedule:
    """``step -> learning rate`` for the whole run (see the module docstring).

    ``warmup`` applies to the first cycle, ``rewarmup`` to the others; both, and
    ``decay``, are fractions of each cycle's length or numbers of steps. ``decay``
    of ``None`` decays over everything after the (re)warmup, leaving no stable
    phase. ``shape``: the decay's shape, a name or an ``lr_schedule`` section.
    Raises ``ValueError`` when the phases do not fit in a cycle.
    """
    section = lr_schedule_section(shape)
    section.check(min_lr_ratio)
    phases = schedule_phases(
        num_train_steps, warmup=warmup, decay=decay, rewarmup=rewarmup, cycles=cycles, cycle_length=cycle_length
    )
    starts = [start for start, _, _, _ in phases]

    pieces = []
    start_lr = 0.0
    for i, (start, end, ramp, decay_steps) in enumerate(phases):
        length = end - start
        curve = section.curve(learning_rate, min_lr_ratio, decay_steps)
        piece = _cycle(start_lr, learning_rate, ramp, length - decay_steps, decay_steps, curve)
        pieces.append(piece)
        if i + 1 < len(phases):  # evaluated eagerly (small programs compiled), only where a cycle follows
            start_lr = float(piece(length))

    if len(pieces) == 1:
        return pieces[0]
    return optax.join_schedules(pieces, starts[1:])
