"""The Hugging Face bridge: import and export of checkpoints, and what an architecture
plugin implements to take part (:class:`HfConvertible`)."""

from levanter_core.hf.convert import HfConvertible, check_fits, hf_state_dict_shapes, load_hf_weights, to_hf_state_dict

__all__ = ["HfConvertible", "check_fits", "hf_state_dict_shapes", "load_hf_weights", "to_hf_state_dict"]
