"""The Hugging Face bridge: import and export of checkpoints, and what an architecture
plugin implements to take part (:class:`HfConvertible`, or declared with :class:`HfMapped`
and :class:`HfKey`; fused tensor layouts with :func:`fuse` / :func:`unfuse`)."""

from levanter_core.hf.convert import HfConvertible, check_fits, hf_state_dict_shapes, load_hf_weights, to_hf_state_dict
from levanter_core.hf.layouts import fuse, unfuse
from levanter_core.hf.mapping import DECODER_HF_KEYS, REQUIRED, HfKey, HfMapped

__all__ = [
    "DECODER_HF_KEYS",
    "REQUIRED",
    "HfConvertible",
    "HfKey",
    "HfMapped",
    "check_fits",
    "fuse",
    "hf_state_dict_shapes",
    "load_hf_weights",
    "to_hf_state_dict",
    "unfuse",
]
