"""The chat template a run's chat data was rendered with, written with an export when it is not
the tokenizer's own, so that the exported model is prompted as it was trained."""

from __future__ import annotations

import json
import os

from levanter_core.data.formats import BUILTIN_CHAT_TEMPLATE
from levanter_core.data.tokenizer import load_tokenizer
from levanter_core.errors import PluginError
from levanter_core.fileio import write_text_atomically
from levanter_core.plugins import registry


def _trained_chat_template(run_config: dict, tokenizer) -> str | None:
    """The chat template a run's chat data was rendered with when it is not the tokenizer's
    own (the format's ``chat_template``, or the built-in template for a tokenizer without one):
    written with the export, so that ``transformers`` and ``levanter sample --chat`` prompt the
    model as it was trained. None for a run without chat data, or one the tokenizer's own
    template rendered. Chat data is a source whose format renders conversations: ``chat``,
    or any format with a ``chat_template`` setting (preference pairs)."""
    fmt = _chat_format(run_config)
    if fmt is None:
        return None
    return fmt.get("chat_template") or (None if tokenizer.chat_template else BUILTIN_CHAT_TEMPLATE)


def _chat_format(run_config: dict) -> dict | None:
    """The ``format`` section of the first of a run's sources whose format renders
    conversations with a chat template, or None."""
    data = run_config.get("data") or {}
    sources = list((data.get("configs") or {}).values()) or [data]
    for source in sources:
        fmt = source.get("format") if isinstance(source, dict) else None
        if not isinstance(fmt, dict):
            continue
        if fmt.get("type") == "chat" or "chat_template" in fmt:
            return fmt
        try:
            if "chat_template" in registry("data_format").get(str(fmt.get("type"))).config_cls.model_fields:
                return fmt
        except (KeyError, PluginError):  # a format no longer installed: it cannot say
            continue
    return None


def _write_trained_chat_template(run_config: dict, output: str) -> None:
    """Give the tokenizer files written to ``output`` the chat template the run trained with,
    when it is not theirs already (see :func:`_trained_chat_template`): in
    ``chat_template.jinja`` if they have one (``transformers`` prefers it), else as
    ``chat_template`` in ``tokenizer_config.json``."""
    if _chat_format(run_config) is None or not os.path.isfile(os.path.join(output, "tokenizer.json")):
        return
    template = _trained_chat_template(run_config, load_tokenizer(output))
    if template is None:
        return
    jinja = os.path.join(output, "chat_template.jinja")
    if os.path.isfile(jinja):
        write_text_atomically(jinja, template)
        return
    path = os.path.join(output, "tokenizer_config.json")
    tokenizer_config = {}
    if os.path.isfile(path):
        with open(path) as f:
            tokenizer_config = json.load(f)
    tokenizer_config["chat_template"] = template
    write_text_atomically(path, json.dumps(tokenizer_config, indent=2) + "\n")
