"""The ``optimizer:`` section: what every optimizer shares.

An optimizer plugin subclasses :class:`OptimizerConfig`, registers it with the
``register_optimizers`` hook, and implements :meth:`OptimizerConfig.build`. The
base class provides the learning-rate schedule (:meth:`lr_scheduler`), the
weight-decay mask (:meth:`build_weight_decay_mask`) and the wrappers every
optimizer shares (``skip_bad_steps``, applied by :meth:`build_for_trainer`), so
every optimizer reads the same fields the same way.
"""

from __future__ import annotations

import abc
import itertools
import re
import warnings
from collections.abc import Callable
from typing import Annotated, Any

import haliax as hax
import haliax.nn as hnn
import jax
import optax
from pydantic import AfterValidator, BeforeValidator, Field, ValidationInfo, field_validator, model_validator

from levanter_core.config.base import TypedConfig, accepted_only_as
from levanter_core.errors import ConfigError
from levanter_core.optim.schedule import LrSchedule, PhaseError, learning_rate_schedule, schedule_phases
from levanter_core.optim.skipstep import SkipStepConfig, skip_step_section
from levanter_core.optim.transforms import decoupled_weight_decay

PyTree = Any

# Layers whose `weight` is a matrix multiplied into the activations: the parameters
# weight decay is meant for. Biases, norms and embeddings are left alone. A module that keeps
# such matrices as plain arrays (the core's mixture-of-experts experts and router) names them
# in a class attribute `weight_decay_fields`.
_LINEAR_LAYERS = (hnn.Linear, hnn.MoELinear)


def _decayed_fields(node) -> tuple[str, ...] | None:
    """The fields of ``node`` that the default mask decays, or None if it is not such a layer."""
    if isinstance(node, _LINEAR_LAYERS):
        return ("weight",)
    return getattr(type(node), "weight_decay_fields", None)


def _check_fraction_or_steps(value: int | float, info: ValidationInfo) -> int | float:
    if value < 0:
        raise ValueError(f"{info.field_name} must be a fraction (a float below 1) or a number of steps, not negative")
    if isinstance(value, float) and value >= 1 and not value.is_integer():
        raise ValueError(
            f"{info.field_name}={value}: a value of 1 or more is a number of steps and must be whole; "
            "write a fraction below 1 for a share of the cycle"
        )
    return value


FractionOrSteps = Annotated[int | float, AfterValidator(_check_fraction_or_steps)]


def parameter_path(key_path: tuple) -> str:
    """The dotted name of a parameter, e.g. ``transformer.blocks.stacked.attn.c_attn.weight``,
    from a JAX key path (as ``jax.tree_util.tree_flatten_with_path`` gives it, with
    NamedArrays treated as leaves)."""
    parts = []
    for key in key_path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        else:  # DictKey, FlattenedIndexKey
            parts.append(str(key.key))
    return ".".join(parts)


_SkipBadSteps = Annotated[SkipStepConfig | None, BeforeValidator(skip_step_section)]
"""``skip_bad_steps`` as written (false, true, a window length or a section), held as a section or None."""


class OptimizerConfig(TypedConfig, abc.ABC):
    """Base class of optimizer configs (the ``optimizer:`` section): learning rate and its
    schedule, weight decay and which parameters it applies to."""

    learning_rate: float = Field(6e-4, ge=0)
    """The peak learning rate, reached at the end of warmup."""
    weight_decay: float = Field(0.1, ge=0)
    """Decoupled weight decay (as in AdamW), scaled by the learning rate. 0 turns it off."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """The learning rate decays to ``min_lr_ratio * learning_rate`` at the end of each cycle."""
    warmup: FractionOrSteps = 0.01
    """Linear warmup from 0 at the start of training: a fraction of the (first) cycle if below 1,
    else a number of steps. 0 means no warmup."""
    decay: FractionOrSteps | None = None
    """Length of the decay phase at the end of each cycle: a fraction of the cycle if below 1, else a
    number of steps. None decays over everything after the (re)warmup, leaving no stable phase;
    anything shorter leaves a stable phase at the peak learning rate in between."""
    rewarmup: FractionOrSteps = 0.0
    """With several cycles, the linear ramp at the start of each later cycle, from the previous
    cycle's final learning rate back to the peak: a fraction of the cycle if below 1, else a number
    of steps. 0 jumps straight back to the peak."""
    cycle_length: int | float | list[int] | None = None
    """Length of each cycle: a number of steps, a float up to 1 for a fraction of the run, or a list
    of lengths. None means a single cycle. Cannot be combined with ``cycles``."""
    cycles: int | list[int] | None = None
    """The number of (equal) cycles, or a list of the steps where cycles end. None means a single
    cycle. Cannot be combined with ``cycle_length``."""
    cooldown: FractionOrSteps | None = None
    """Deprecated (as in Levanter): a final phase of this many steps (or this fraction of the
    run) after the schedule above, which then fits in the steps before it, going linearly from
    the schedule's last learning rate to ``min_lr_ratio * learning_rate``. Write ``decay``
    instead."""
    haps: list[int] | None = None
    """Deprecated in Levanter, where it no longer has any effect; only null is accepted. Write
    ``cycles`` (a list of the steps where cycles end) instead."""
    lr_schedule: LrSchedule = "cosine"  # type: ignore[assignment]  # a name, made a section by validate_default
    """Shape of the decay phase (warmup, the stable phase and cycles are the same for every
    shape): a name, ``constant`` (no decay), ``linear``, ``cosine``, ``inv_sqrt`` (``1/sqrt``) or
    ``inv`` (``1/x``), or, as in Levanter, a section with ``type`` and that shape's fields:
    ``{type: cosine, exponent: 2.0}``, ``{type: inv_sqrt, timescale: 1000}``, or the Power
    Scheduler ``{type: power, batch_size: 256, seq_length: 1024, a: 4.6, b: -0.51}``. ``linear``,
    ``cosine``, ``inv``, and ``inv_sqrt`` without a timescale, end exactly at the minimum
    learning rate; the last two choose their timescale to land there, so they need
    ``min_lr_ratio > 0`` (Levanter's ``inv_sqrt`` instead holds the peak until step 10000 and
    then falls as ``1/sqrt`` without aiming at the minimum). ``power`` ignores
    ``min_lr_ratio``."""
    weight_decay_modules: list[str] | str | None = None
    """Which parameters get weight decay: a regular expression, or a list of them, searched for in
    each parameter's dotted path (e.g. ``transformer.blocks.stacked.attn.c_attn.weight``); a plain
    name such as ``attn`` matches every path containing it. For GPT-2 style models, for example:
    ``.*attn.*weight|.*mlp.*weight|.*token_embeddings``."""
    default_weight_decay_mask: bool | None = None
    """Decay the weights of linear layers (not biases, norms or embeddings). None: only when
    ``weight_decay_modules`` is unset. True: also when it is set, in addition to its matches.
    False: never; with ``weight_decay_modules`` unset, every parameter is decayed."""
    skip_bad_steps: _SkipBadSteps = False  # type: ignore[assignment]  # validated into None
    """Skip a step (leave the parameters and optimizer state unchanged) whose loss or gradient
    norm is far above those of recent steps. false: never skip. true: a window of the last 128
    steps and a threshold of 6 standard deviations. A number: that window length. Or a section
    with ``rolling_interval_length`` and ``sigma_factor``. The window is part of the optimizer
    state, so it is checkpointed; each step logs ``optim/skipped_step`` (0 or 1)."""

    @field_validator("cycle_length")
    @classmethod
    def _check_cycle_length(cls, value):
        lengths = value if isinstance(value, list) else [value] if value is not None else []
        if any(length <= 0 for length in lengths):
            raise ValueError(f"cycle lengths must be positive, got {value!r}")
        if isinstance(value, float) and value > 1 and not value.is_integer():
            raise ValueError(
                f"cycle_length={value}: a value above 1 is a number of steps and must be whole; "
                "write a fraction up to 1 for a share of the run"
            )
        return value

    @field_validator("cycles")
    @classmethod
    def _check_cycles(cls, value):
        if isinstance(value, int) and value < 1:
            raise ValueError(f"cycles must be at least 1, got {value}")
        if isinstance(value, list) and (
            any(step < 0 for step in value) or any(b <= a for a, b in itertools.pairwise(value))
        ):
            raise ValueError(f"cycles as a list holds the steps where cycles end, in increasing order; got {value}")
        return value

    @field_validator("weight_decay_modules")
    @classmethod
    def _check_patterns(cls, value):
        for pattern in [value] if isinstance(value, str) else value or []:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"invalid regular expression {pattern!r}: {e}") from None
        return value

    _no_haps = accepted_only_as(
        None, "haps", why="haps is deprecated and has no effect in Levanter; write cycles (the steps where cycles end)"
    )

    @model_validator(mode="after")
    def _check_combination(self):
        if self.cycles is not None and self.cycle_length is not None:
            raise ValueError("It is an error to specify both `cycles` and `cycle_length`; keep one of them")
        self.lr_schedule.check(self.min_lr_ratio)
        return self

    @abc.abstractmethod
    def build(self, num_train_steps: int) -> optax.GradientTransformation:
        """The optimizer for a run of ``num_train_steps`` steps. Its updates are meant to be
        added to the parameters (``optax.apply_updates``)."""

    def decayed_weights(self, adamc_schedule: optax.Schedule | None = None) -> list[optax.GradientTransformation]:
        """The decoupled weight decay, as parts of an ``optax.chain`` to place before the
        learning rate: none when ``weight_decay`` is 0, else ``weight_decay * param`` added to the
        update of each parameter :meth:`build_weight_decay_mask` selects. ``adamc_schedule``: the
        run's learning-rate schedule, to scale each step's decay by its rate over the peak
        ``learning_rate`` (AdamC)."""
        if self.weight_decay == 0:
            return []
        decay = decoupled_weight_decay(
            self.weight_decay,
            self.build_weight_decay_mask(),
            adamc=adamc_schedule is not None,
            lr_schedule=adamc_schedule,
            peak_lr=self.learning_rate,
        )
        return [decay]

    def params_for_evaluation(self, params: PyTree, opt_state: PyTree) -> PyTree:
        """The parameters that evaluation, samples and exports use, from the trained ``params``
        and the optimizer's state (as :meth:`build_for_trainer`'s optimizer keeps it): the
        trained ones themselves, unless an optimizer evaluates elsewhere (schedule-free
        methods evaluate an average of their iterates)."""
        return params

    def build_for_trainer(self, num_train_steps: int) -> optax.GradientTransformationExtraArgs:
        """What the trainer runs: :meth:`build`'s optimizer inside the wrappers that every
        optimizer shares (``skip_bad_steps``). Its ``update`` takes the step's loss as the
        keyword argument ``loss``."""
        optimizer = optax.with_extra_args_support(self.build(num_train_steps))
        if self.skip_bad_steps is not None:
            optimizer = self.skip_bad_steps.wrap(optimizer)
        return optimizer

    def lr_scheduler(self, num_train_steps: int, learning_rate: float | None = None) -> optax.Schedule:
        """``step -> learning rate`` for a run of ``num_train_steps`` steps. Works on a Python
        int and on a traced step inside ``jit``. ``learning_rate``: the peak of the schedule
        when not ``self.learning_rate`` (an optimizer with a second learning rate, such as
        Muon's ``adam_lr`` for the parameters it leaves to AdamW, gives it the same shape).

        Raises :class:`ConfigError` when the cycles or phases do not fit the run.
        """
        peak = self.learning_rate if learning_rate is None else learning_rate
        if self.cooldown is not None:
            warnings.warn("optimizer.cooldown is deprecated; use decay", DeprecationWarning, stacklevel=2)
        cooldown_steps = self.check_schedule(num_train_steps)
        try:
            main = learning_rate_schedule(
                learning_rate=peak,
                num_train_steps=num_train_steps - cooldown_steps,
                min_lr_ratio=self.min_lr_ratio,
                warmup=self.warmup,
                decay=self.decay,
                rewarmup=self.rewarmup,
                cycles=self.cycles,
                cycle_length=self.cycle_length,
                shape=self.lr_schedule,
            )
        except ValueError as e:
            raise ConfigError(f"optimizer: {e}") from None
        if not cooldown_steps:
            return main
        last = float(main(num_train_steps - cooldown_steps - 1))
        tail = optax.linear_schedule(last, peak * self.min_lr_ratio, cooldown_steps)
        return optax.join_schedules([main, tail], [num_train_steps - cooldown_steps])

    def check_schedule(self, num_train_steps: int) -> int:
        """Check that the schedule's cycles and phases (``warmup``, ``decay``, ``rewarmup``,
        ``cycles``, ``cycle_length``, ``cooldown``) fit a run of ``num_train_steps`` steps, without
        building it; return the ``cooldown`` in steps. Raises :class:`ConfigError` whose message
        starts with the dotted field to change."""
        cooldown_steps = 0
        if self.cooldown is not None:
            cooldown_steps = int(self.cooldown * num_train_steps) if self.cooldown < 1 else int(self.cooldown)
            if not 0 <= cooldown_steps < num_train_steps:
                raise ConfigError(
                    f"optimizer.cooldown: {self.cooldown} leaves no steps of the {num_train_steps}-step run for the "
                    "schedule"
                )
        try:
            schedule_phases(
                num_train_steps - cooldown_steps,
                warmup=self.warmup,
                decay=self.decay,
                rewarmup=self.rewarmup,
                cycles=self.cycles,
                cycle_length=self.cycle_length,
            )
        except PhaseError as e:
            raise ConfigError(f"optimizer.{e.field}: {e}") from None
        return cooldown_steps

    def build_weight_decay_mask(self) -> Callable[[PyTree], PyTree] | None:
        """A function from parameters to a tree of the same structure with a bool in place of
        each array (NamedArrays included): True where weight decay applies. None means every
        parameter is decayed (``default_weight_decay_mask: false`` without
        ``weight_decay_modules``)."""
        if self.weight_decay_modules is None and self.default_weight_decay_mask is False:
            return None
        use_default = self.default_weight_decay_mask is True or (
            self.default_weight_decay_mask is None and self.weight_decay_modules is None
        )
        patterns = self.weight_decay_modules
        regexes = [re.compile(p) for p in ([patterns] if isinstance(patterns, str) else patterns or [])]

        def mask(params: PyTree) -> PyTree:
            linear_weights = set()
            if use_default:
                layers, _ = jax.tree_util.tree_flatten_with_path(
                    params, is_leaf=lambda x: _decayed_fields(x) is not None or hax.is_named_array(x)
                )
                linear_weights = {
                    path + (jax.tree_util.GetAttrKey(field),)
                    for path, node in layers
                    for field in _decayed_fields(node) or ()
                }

            def decays(path, _leaf) -> bool:
                if path in linear_weights:
                    return True
                name = parameter_path(path)
                return any(r.search(name) for r in regexes)

            return jax.tree_util.tree_map_with_path(decays, params, is_leaf=hax.is_named_array)

        return mask
