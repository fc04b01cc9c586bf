"""Reading the files beside a tokenizer: its ``tokenizer_config.json`` (and other JSON
objects, such as ``special_tokens_map.json``), the special tokens named in them, and its chat
template."""

from __future__ import annotations

import json
import posixpath

from levanter_core.errors import DataError


def _tokenizer_config(fs, directory: str) -> dict:
    """The ``tokenizer_config.json`` beside a tokenizer; {} if there is none. A file that
    is there but unreadable is an error: silently losing its chat template would change
    what is trained on."""
    return _read_json_object(fs, posixpath.join(directory, "tokenizer_config.json"), missing_ok=True)


def _token_text(token) -> str | None:
    # Special tokens are written as text, or as an AddedToken object with a "content".
    return token.get("content") if isinstance(token, dict) else token


def _chat_template(fs, directory: str, config: dict) -> str | None:
    """The ``chat_template`` of the config (a string, or a list of named templates of which
    ``default`` is used), else the ``chat_template.jinja`` file, else None."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    jinja_path = posixpath.join(directory, "chat_template.jinja")
    if fs.isfile(jinja_path):
        with fs.open(jinja_path, "r", encoding="utf-8") as f:
            return f.read()
    return None


def _read_json_object(fs, path: str, missing_ok: bool = False) -> dict:
    """The JSON object in file ``path``; {} if there is no such file and ``missing_ok``. A
    file that is not a JSON object is an error naming the file (and the line)."""
    if missing_ok and not fs.isfile(path):
        return {}
    with fs.open(path, "r", encoding="utf-8") as f:
        try:
            value = json.load(f)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(value, dict):
        raise DataError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value
