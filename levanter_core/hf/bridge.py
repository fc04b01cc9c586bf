"""Moving models between Hugging Face checkpoints and ours: ``levanter import-hf``,
``levanter export-hf`` and the ``initialize_from_hf`` training option.

The public face of :mod:`levanter_core.hf.io`, whose modules each do one part of it: every name
imported from ``levanter_core.hf.bridge`` is here, from the module that defines it.

Which of our model types reads a Hugging Face ``config.json`` is decided by the
``model_type_for_hf_config`` hook (two plugins that claim it for different types are a clash:
see :meth:`levanter_core.plugins.PluginManager.model_type_for_hf_config`); the per-model
translation is the plugin's :class:`~levanter_core.hf.convert.HfConvertible` config.
"""

from __future__ import annotations

from levanter_core.hf.io.chat_template import _chat_format, _trained_chat_template, _write_trained_chat_template
from levanter_core.hf.io.checkpoint_model import (
    AVERAGED_MODEL,
    CheckpointModel,
    _load_lora_base,
    _run_lora,
    load_checkpoint_model,
    read_metadata_of,
)
from levanter_core.hf.io.exporter import (
    _DROPPED_HF_KEYS,
    _check_output,
    _export_peft,
    export_hf,
    local_output,
    parse_size,
    write_hf_model,
)
from levanter_core.hf.io.importer import HfModel, import_hf, load_hf_model
from levanter_core.hf.io.source import config_from_hf, read_hf_config, read_source_hf_config, resolve_source
from levanter_core.hf.io.special_tokens import SPECIAL_TOKENS, _special_token_ids, _tokenizer_special_ids, in_vocabulary
from levanter_core.hf.io.tokenizer_files import (
    HF_TOKENIZER_DIR,
    TOKENIZER_FILES,
    _copy_tokenizer_files,
    _run_tokenizer,
    _tokenizer_directory,
    _write_tokenizer,
)
from levanter_core.hf.io.vocab import _tokens_by_id, check_tokenizer_fits, resize_vocab

__all__ = [
    "AVERAGED_MODEL",
    "HF_TOKENIZER_DIR",
    "SPECIAL_TOKENS",
    "TOKENIZER_FILES",
    "_DROPPED_HF_KEYS",
    "CheckpointModel",
    "HfModel",
    "_chat_format",
    "_check_output",
    "_copy_tokenizer_files",
    "_export_peft",
    "_load_lora_base",
    "_run_lora",
    "_run_tokenizer",
    "_special_token_ids",
    "_tokenizer_directory",
    "_tokenizer_special_ids",
    "_tokens_by_id",
    "_trained_chat_template",
    "_write_tokenizer",
    "_write_trained_chat_template",
    "check_tokenizer_fits",
    "config_from_hf",
    "export_hf",
    "import_hf",
    "in_vocabulary",
    "load_checkpoint_model",
    "load_hf_model",
    "local_output",
    "parse_size",
    "read_hf_config",
    "read_metadata_of",
    "read_source_hf_config",
    "resize_vocab",
    "resolve_source",
    "write_hf_model",
]
