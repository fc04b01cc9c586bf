"""Levanter's ``distill_lm`` program's config (``marin-community/marin``, ``lib/levanter``), read
as a run of the ``distill`` objective (the ``levanter-distill`` plugin)::

    student_model: {type: llama, ...}          ->  model: {type: llama, ...}
    student_initialize_from_hf: org/small      ->  initialize_from_hf: org/small
    teacher_initialize_from_hf: org/large      ->  objective: {type: distill, teacher: org/large,
    objective: forward_kl                                      temperature: 1, alpha: 1}

The teacher's architecture is that of its checkpoint's ``config.json`` (Levanter's default,
``teacher_use_hf_model_config: true``), so ``teacher_model`` is read and dropped. Levanter's
other objectives (``projected_hidden``, ``taid``) and the teacher-derived initialization of the
student (``teacher_initialization`` and its settings) are refused by name.
"""

from __future__ import annotations

from typing import Any

from levanter_core.config.loader import Sources
from levanter_core.config.sft import ProgramTranslation, TranslatedSources

DISTILL_FIELDS = {
    "student_model", "teacher_model", "teacher_initialize_from_hf", "teacher_use_hf_model_config",
    "student_initialize_from_hf", "student_use_hf_model_config", "teacher_initialization", "taid",
    "student_anchor_indices", "teacher_anchor_indices",
}  # fmt: skip
"""Top-level fields of Levanter's ``distill_lm`` that a training config does not have."""

TEACHER_DEFAULT = "Qwen/Qwen3-32B"
"""``teacher_initialize_from_hf`` of ``distill_lm`` when a config leaves it out."""

_UNUSED_WITHOUT_INITIALIZATION = ("initialization_axis_mapping", "structured_use_saliency", "factorization_rank")
"""Settings of the teacher-derived initialization, accepted only at their defaults (null, false)."""


def is_levanter_distill(raw: Any) -> bool:
    """Whether ``raw`` is written for Levanter's ``distill_lm``: it has one of its own top-level
    fields and no ``model`` section of ours."""
    return isinstance(raw, dict) and "model" not in raw and bool(DISTILL_FIELDS & set(raw))


def translate_levanter_distill(raw: dict, sources: Sources) -> tuple[dict, Sources]:
    """``raw`` (see :func:`is_levanter_distill`) as a training config with a ``distill``
    objective. Raises :class:`~levanter_core.errors.ConfigError` naming the field for what has
    no meaning here."""
    return _Distill(raw, sources).run()


class _Distill(ProgramTranslation):
    program = "distill_lm"

    def run(self) -> tuple[dict, Sources]:
        raw = dict(self.raw)
        kind = raw.pop("objective", "forward_kl")
        if kind in ("projected_hidden", "taid"):
            self.fail(("objective",), f"Levanter's {kind} distillation is not available here; use forward_kl")
        if kind != "forward_kl":
            self.fail(("objective",), f"expected forward_kl, got {kind!r}")
        raw.pop("taid", None)  # the taid objective's settings, unused by forward_kl
        if raw.pop("teacher_initialization", None) is not None:
            self.fail(
                ("teacher_initialization",),
                "initializing the student from the teacher's weights is not available here; remove it (or set it "
                "to null) and start the student from student_initialize_from_hf or at random",
            )
        for name in _UNUSED_WITHOUT_INITIALIZATION:
            if raw.pop(name, None) not in (None, False):
                self.fail((name,), f"{name} belongs to teacher_initialization, which is not available here; remove it")
        for name in ("student_anchor_indices", "teacher_anchor_indices"):
            if raw.pop(name, None) is not None:
                self.fail((name,), f"{name} belongs to the projected_hidden objective, which is not available here")
        if raw.pop("teacher_use_hf_model_config", True) is not True:
            self.fail(
                ("teacher_use_hf_model_config",),
                "the teacher's architecture is that of its checkpoint's config.json here; remove it (or set it to true)",
            )
        raw.pop("teacher_model", None)
        self.move(raw, "student_model", "model")
        self.move(raw, "student_initialize_from_hf", "initialize_from_hf")
        self.move(raw, "student_use_hf_model_config", "use_hf_model_config")
        teacher = raw.pop("teacher_initialize_from_hf", TEACHER_DEFAULT)
        raw["objective"] = {"type": "distill", "teacher": teacher, "temperature": 1.0, "alpha": 1.0}
        self.written[("objective", "teacher")] = ("teacher_initialize_from_hf",)
        written = dict(self.sources.written) if isinstance(self.sources, TranslatedSources) else {}
        written.update(self.written)
        return raw, TranslatedSources(self.sources.main_file, self.sources.places, written)

    def move(self, raw: dict, theirs: str, ours: str) -> None:
        if theirs in raw:
            raw[ours] = raw.pop(theirs)
            self.written[(ours,)] = (theirs,)
