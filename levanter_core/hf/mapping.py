"""Translating a model config to and from Hugging Face's ``config.json``, declared rather
than written out: each of our fields names its Hugging Face key and the default
``transformers`` assumes when a file leaves the key out.

A config class that mixes in :class:`HfMapped` lists its keys in ``hf_keys`` and gets
``from_hf_config``, ``to_hf_config`` and ``hf_ignored_tensors``::

    class MyConfig(DecoderConfig):
        hf_keys: ClassVar = {
            **DecoderConfig.hf_keys,
            "layer_norm_epsilon": HfKey("rms_norm_eps", 1e-5),   # this family's default
            "use_bias": HfKey("attention_bias", False),
        }
        hf_refused: ClassVar = {"mlp_bias": (False, None)}       # accepted values, else an error

What the mapping covers:

* **config fields**: :class:`HfKey` (key, default, and optional conversions each way); a
  key whose value we cannot honour is refused by name (``hf_refused``);
* **rotary embeddings**: ``rope`` is read with :func:`~levanter_core.layers.rotary.rotary_from_hf`
  and written as ``rope_parameters``;
* **tied heads**: a checkpoint of a model with ``tie_word_embeddings`` may still carry
  ``lm_head.weight``, which is ignored;
* **special token ids** (``bos_token_id``, ``eos_token_id``, ``pad_token_id``) are the core's:
  the importer keeps the original ``config.json`` and the exporter takes them from the
  tokenizer, so a family never lists them.

Fused and split tensor layouts are :mod:`levanter_core.hf.layouts`; stacked and unstacked
layers are handled by the modules (``hnn.Stacked`` unstacks into ``layers.0``, ...).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from levanter_core.hf.convert import HfConvertible
from levanter_core.layers.rotary import RotaryConfig, rotary_from_hf

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo

REQUIRED = object()
"""An :class:`HfKey` default meaning the key must be present."""


@dataclasses.dataclass(frozen=True)
class HfKey:
    """One of our fields as a ``config.json`` key.

    ``default``: what ``transformers`` assumes when the key is absent (:data:`REQUIRED`: it
    must be there). ``read(value, hf)`` turns the file's value (``hf`` is the whole file)
    into ours; ``write(value, config)`` ours into the file's; ``written``: whether
    ``to_hf_config`` writes the key (False for keys only read)."""

    name: str
    default: Any = REQUIRED
    read: Callable[[Any, dict], Any] | None = None
    write: Callable[[Any, Any], Any] | None = None
    written: bool = True

    def value_in(self, hf: dict, field: str) -> Any:
        if self.name not in hf:
            if self.default is REQUIRED:
                raise ValueError(f"config.json has no {self.name!r}, which gives the model's {field}")
            value = self.default
        else:
            value = hf[self.name]
        return self.read(value, hf) if self.read is not None else value


def _default_head_dim(value, hf: dict):
    """``head_dim`` as written, or None (ours: derived) when absent, null, or the implied one."""
    implied = hf["hidden_size"] // hf["num_attention_heads"]
    return None if value in (None, implied) else value


DECODER_HF_KEYS: dict[str, HfKey] = {
    "seq_len": HfKey("max_position_embeddings"),
    "hidden_dim": HfKey("hidden_size"),
    "intermediate_dim": HfKey("intermediate_size"),
    "num_layers": HfKey("num_hidden_layers"),
    "num_heads": HfKey("num_attention_heads"),
    "num_kv_heads": HfKey("num_key_value_heads", None, read=lambda v, hf: v or hf["num_attention_heads"]),
    "head_dim": HfKey("head_dim", None, read=_default_head_dim),
    "activation_function": HfKey("hidden_act", "silu"),
    "initializer_range": HfKey("initializer_range", 0.02),
    "layer_norm_epsilon": HfKey("rms_norm_eps", 1e-6),
    "tie_word_embeddings": HfKey("tie_word_embeddings", False),
}
"""The keys every decoder-only family shares (Llama's names and transformers' usual defaults)."""


class HfMapped(HfConvertible):
    """Mixin for a config class translated by declaration (see the module docstring)."""

    hf_model_type: ClassVar[str]
    """The ``model_type`` written into ``config.json``."""

    hf_keys: ClassVar[dict[str, HfKey]] = {}
    """Our field name -> its ``config.json`` key."""

    hf_refused: ClassVar[dict[str, tuple]] = {}
    """``config.json`` key -> the values we can honour (absence is always fine); any other
    value is refused with a ``ValueError`` naming the key."""

    hf_rope_theta: ClassVar[float] = 10000.0
    """``rope_theta`` when a file has none."""

    hf_partial_rotary: ClassVar[bool] = False
    """Whether the Hugging Face architecture rotates part of each head when
    ``partial_rotary_factor`` < 1 (Phi-3 does; Llama's and most others' code would rotate the
    whole head or fail). When not, such a file is refused on import and such a config on export."""

    if TYPE_CHECKING:  # what the pydantic config class that mixes it in has
        model_fields: ClassVar[dict[str, FieldInfo]]
        rope: RotaryConfig

    @classmethod
    def refuse_unsupported(cls, hf: dict) -> None:
        for key, accepted in cls.hf_refused.items():
            if key in hf and hf[key] not in accepted:
                shown = " or ".join(json.dumps(a) for a in accepted)
                raise ValueError(f"{key}: {json.dumps(hf[key])} is not supported (a {cls.__name__} needs {shown})")

    @classmethod
    def rope_from_hf(cls, hf: dict):
        """The ``rope`` field from ``rope_parameters`` (or a legacy ``rope_scaling``)."""
        params = hf.get("rope_parameters") or hf.get("rope_scaling")
        rope = rotary_from_hf(params, default_theta=hf.get("rope_theta", cls.hf_rope_theta), hf_config=hf)
        if rope.partial_rotary_factor != 1.0 and not cls.hf_partial_rotary:
            raise ValueError(
                f"partial_rotary_factor = {rope.partial_rotary_factor} is not supported: Hugging Face's "
                f"{getattr(cls, 'hf_architecture', cls.__name__)} rotates whole heads"
            )
        return rope

    @classmethod
    def hf_fields(cls, hf: dict) -> dict:
        """Our fields from a ``config.json`` (as a dict); a family extends it for what the
        declarations cannot say."""
        cls.refuse_unsupported(hf)
        fields = {field: key.value_in(hf, field) for field, key in cls.hf_keys.items()}
        if "rope" in cls.model_fields:
            fields["rope"] = cls.rope_from_hf(hf)
        return fields

    @classmethod
    def from_hf_config(cls, hf_config: dict):
        return cls(**cls.hf_fields(hf_config))

    def to_hf_config(self, vocab_size: int) -> dict:
        out = {"model_type": self.hf_model_type, "vocab_size": vocab_size}
        for field, key in self.hf_keys.items():
            if not key.written:
                continue
            value = getattr(self, field)
            out[key.name] = key.write(value, self) if key.write is not None else value
        if "rope" in type(self).model_fields:
            if self.rope.partial_rotary_factor != 1.0 and not self.hf_partial_rotary:
                raise ValueError(
                    f"rope.partial_rotary_factor {self.rope.partial_rotary_factor} has no Hugging Face "
                    f"{getattr(self, 'hf_architecture', type(self).__name__)} equivalent: it rotates whole heads"
                )
            out["rope_parameters"] = self.rope.to_hf()
        return out

    def hf_ignored_tensors(self) -> frozenset[str]:
        # a tied checkpoint may still carry a copy of the embeddings as the head
        return frozenset({"lm_head.weight"}) if getattr(self, "tie_word_embeddings", False) else frozenset()


__all__ = ["DECODER_HF_KEYS", "REQUIRED", "HfKey", "HfMapped"]
