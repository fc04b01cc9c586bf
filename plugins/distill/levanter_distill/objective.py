"""Knowledge distillation (``objective: {type: distill, teacher: SOURCE, ...}``).

The run's model, the *student*, learns from a frozen *teacher* (Hinton et al., 2015, "Distilling
the Knowledge in a Neural Network") as well as from the data: at every position whose next token
the loss counts, with temperature ``T`` and weight ``alpha``,

    loss = alpha * T^2 * KL(p_T || q_T) + (1 - alpha) * CE(data)
    p_T = softmax(teacher logits / T)      q_T = softmax(student logits / T)

each term the mean over those positions. ``T^2`` keeps the gradients of the soft targets the size
of the data's as ``T`` grows. With ``top_k``, ``p_T`` keeps only the teacher's ``k`` largest
logits at each position, renormalized over them (the others' probabilities are 0 and add nothing
to the KL). Levanter's ``distill_lm`` ``forward_kl`` is ``alpha = 1, T = 1``.

The teacher is loaded from one of our checkpoints, an import, or a Hugging Face model directory
or hub name (:func:`~levanter_core.models.source.load_model_source`) when the run starts; it may
be another architecture, larger than the student, but must share its vocabulary. The trainer
keeps it in the state's ``reference`` slot (:meth:`~levanter_core.objective.Objective.frozen_model`),
so it is an argument of the compiled step, and leaves it out of checkpoints (every start loads it
again). Its logits are computed under ``stop_gradient``.

Evaluation is the student's own next-token loss (and bits per byte), as for the ``lm``
objective, so held-out losses compare with those of a run on the data alone.
"""

from __future__ import annotations

from typing import Any

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray
from pydantic import Field

from levanter_core.config.base import ConfigModel
from levanter_core.errors import ConfigError
from levanter_core.models.cross_entropy import soft_cap
from levanter_core.models.lm import _attn_kwargs, _targets_and_mask, as_example
from levanter_core.models.source import load_model_source
from levanter_core.objective import LmObjective


class DistillOptions(ConfigModel):
    """The settings of ``objective: {type: distill, ...}``."""

    teacher: str
    """The frozen model to learn from: one of our checkpoints (a run's checkpoint directory or a
    ``step-N`` directory, an import), or a Hugging Face model directory or hub name. Its
    vocabulary must be the student's."""

    temperature: float = Field(1.0, gt=0)
    """``T``: both models' logits are divided by it before the softmax; above 1 the teacher's
    distribution is softer and says more about the tokens it ranks below the first. The KL term
    is scaled by ``T^2``."""

    alpha: float = Field(1.0, ge=0, le=1)
    """The weight of the teacher's term: ``alpha * T^2 * KL + (1 - alpha) * CE(data)``. 1 (the
    default): the teacher alone, as Levanter's ``forward_kl``; 0: the data alone."""

    top_k: int | None = Field(None, ge=1)
    """Keep only the teacher's ``top_k`` largest logits at each position, renormalized over
    them; None: the whole vocabulary."""


def next_token_logits(model: Any, example: Any) -> NamedArray:
    """The logits of each position's next token, float32, ``(..., position, vocab)`` (soft-capped
    as the model's own loss caps them)."""
    hidden = model.activations(example.tokens, **_attn_kwargs(example))
    logits = hax.dot(hidden, model.get_lm_head(), axis="embed").astype(jnp.float32)
    return soft_cap(logits, getattr(model.config, "final_logit_soft_cap", None))


def distill_terms(
    student: NamedArray,
    teacher: NamedArray,
    targets: NamedArray,
    mask: NamedArray,
    *,
    temperature: float,
    top_k: int | None,
    vocab: str = "vocab",
) -> tuple[jax.Array, jax.Array]:
    """The mean ``KL(p_T || q_T)`` and the mean cross-entropy of the data over the positions of
    ``mask`` (float weights), from the student's and the teacher's logits ``(..., vocab)``."""
    teacher = teacher.rearrange((..., vocab))
    positions = teacher.axes[:-1]
    t = teacher.array / temperature
    if top_k is not None and top_k < t.shape[-1]:
        kth = jax.lax.top_k(t, top_k)[0][..., -1:]
        t = jnp.where(t >= kth, t, -jnp.inf)  # ties at the k-th logit are all kept
    log_p = jax.nn.log_softmax(t, axis=-1)
    p = jnp.exp(log_p)
    s = student.rearrange(teacher.axes).array
    log_q = jax.nn.log_softmax(s / temperature, axis=-1)
    kl = jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0.0), axis=-1)
    log_probs = jax.nn.log_softmax(s, axis=-1)
    ce = -jnp.take_along_axis(log_probs, targets.rearrange(positions).array[..., None], axis=-1)[..., 0]
    weights = mask.rearrange(positions).array
    count = jnp.maximum(jnp.sum(weights), 1.0)
    return jnp.sum(kl * weights) / count, jnp.sum(ce * weights) / count


class DistillObjective(LmObjective):
    """Next-token prediction taught by a frozen teacher (see the module docstring): batches,
    evaluation and bits per byte are those of :class:`~levanter_core.objective.LmObjective`."""

    name = "distill"
    keeps_reference = True
    options = DistillOptions

    @classmethod
    def from_config(cls, config: Any) -> DistillObjective:
        settings = config.objective_options
        return cls(**dict(settings), seq_len=config.train_length, student=config.model)

    def __init__(
        self,
        *,
        teacher: str,
        temperature: float = 1.0,
        alpha: float = 1.0,
        top_k: int | None = None,
        seq_len: int | None = None,
        student: Any = None,
    ) -> None:
        """``seq_len``: the length the run trains on (the teacher's context must hold it);
        ``student``: the student's model config (for the step's FLOPs)."""
        super().__init__()
        self.teacher, self.temperature, self.alpha, self.top_k = teacher, temperature, alpha, top_k
        self._seq_len, self._student = seq_len, student

    def frozen_model(self, Vocab: Axis) -> Any:
        """The teacher, loaded from ``objective.teacher``; refused (naming the field) when its
        vocabulary is not the student's or its context is shorter than the trained length."""
        loaded = load_model_source(self.teacher)
        if loaded.Vocab.size != Vocab.size:
            raise ConfigError(
                f"objective.teacher: {self.teacher} has a vocabulary of {loaded.Vocab.size} tokens, the student "
                f"{Vocab.size}; distillation compares their predictions token by token, so use a teacher of the "
                "student's tokenizer and vocabulary size"
            )
        context = getattr(loaded.config, "seq_len", None)
        if self._seq_len is not None and context is not None and context < self._seq_len:
            raise ConfigError(
                f"objective.teacher: {self.teacher} reads at most {context} positions, but the run trains on "
                f"{self._seq_len} (train_seq_len or model.seq_len); train on {context} or fewer"
            )
        self._count_teacher_flops(loaded.config, Vocab.size)
        print(f"distilling from teacher {self.teacher} ({type(loaded.config).__name__})", flush=True)
        return loaded.model

    def _count_teacher_flops(self, teacher_config: Any, vocab_size: int) -> None:
        # A step runs the student forward and backward (3 forwards) and the teacher forward once.
        student = self._student.flops_per_token(vocab_size) if self._student is not None else None
        teacher = teacher_config.flops_per_token(vocab_size)
        if student and teacher:
            self.flops_scale = (3 * student + teacher) / (3 * student)

    def loss(
        self, model: Any, example: Any, *, key: jax.Array | None, reference: Any = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """``alpha * T^2 * KL + (1 - alpha) * CE`` of the batch; logs ``distill/kl`` and ``distill/ce``."""
        if reference is None:
            raise ValueError("the distill objective needs its teacher, passed as reference=")
        example = as_example(example)
        targets, mask = _targets_and_mask(example.tokens, example.loss_mask)
        teacher = jax.lax.stop_gradient(next_token_logits(reference, example))
        kl, ce = distill_terms(
            next_token_logits(model, example),
            teacher,
            targets,
            mask,
            temperature=self.temperature,
            top_k=self.top_k,
            vocab=model.Vocab.name,
        )
        loss = self.alpha * self.temperature**2 * kl + (1 - self.alpha) * ce
        return loss, {"distill/kl": kl, "distill/ce": ce}

    def eval_loss(self, model: Any, example: Any, reference: Any = None) -> jax.Array:
        """The student's own next-token loss (the teacher plays no part)."""
        return super().eval_loss(model, example)

    def eval_totals(self, model: Any, example: Any, *constants: Any, reference: Any = None) -> jax.Array:
        """The student's ``[nats, tokens, bytes]``, as for the ``lm`` objective."""
        return super().eval_totals(model, example, *constants)

    def sampled_loss(self, model: Any, example: Any, *, key: jax.Array) -> jax.Array:
        raise NotImplementedError("the distill objective cannot draw targets from its model's predictions")
