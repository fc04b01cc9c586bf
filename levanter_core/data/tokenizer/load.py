"""Loading the tokenizer a spec names (``data.tokenizer``): ``byte``, a ``tokenizer.json`` file
or a directory holding one (a local path or an fsspec URL), or a Hugging Face hub model read
through the Hugging Face cache; and checking, before a run reads data, that it can be found."""

from __future__ import annotations

import posixpath

import fsspec
from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError
from huggingface_hub.utils import validate_repo_id

from levanter_core.data.tokenizer.base import SPECIAL_TOKEN_ROLES, ByteTokenizer, HfTokenizer, Tokenizer
from levanter_core.data.tokenizer.ctc import CTC_TOKENIZER_CLASS, _is_ctc_tokenizer, _load_ctc_tokenizer
from levanter_core.data.tokenizer.files import _chat_template, _read_json_object, _token_text, _tokenizer_config
from levanter_core.data.tokenizer.special import add_special_tokens, split_tokenizer_spec
from levanter_core.errors import DataError
from levanter_core.fileio import filesystem

HUB_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "vocab.json",
    "special_tokens_map.json",
)
"""The files of a hub model that make its tokenizer (all that is fetched of it): first the two
that messages tell people to download, then the chat template, then what a Wav2Vec2 CTC
tokenizer has in place of a ``tokenizer.json``."""


def load_tokenizer(spec: str) -> Tokenizer:
    """``byte``, a ``tokenizer.json`` file, a directory containing one (local path or fsspec
    URL), or the name of a Hugging Face hub model (``gpt2``, ``meta-llama/Llama-2-7b-hf``)
    that is not a local path: its tokenizer files are read from the Hugging Face cache,
    downloaded into it first when the hub is reachable and ``HF_HUB_OFFLINE`` is not set.

    The end-of-text token is the ``eos_token`` of a ``tokenizer_config.json`` beside the
    ``tokenizer.json``, else the first of ``<|endoftext|>``, ``</s>``, ``<|end_of_text|>``,
    ``<eos>`` that the vocabulary has. The same file gives the ``bos_token`` and
    ``chat_template`` (a ``chat_template.jinja`` beside it is used when the file has none).

    A directory (or hub model) with no ``tokenizer.json`` but a ``vocab.json`` and a
    ``tokenizer_config.json`` naming ``Wav2Vec2CTCTokenizer`` is read as that tokenizer: its
    special tokens from ``tokenizer_config.json`` and ``special_tokens_map.json``, its
    vocabulary rebuilt as a ``tokenizer.json`` that encodes as ``transformers`` does.

    ``BASE+{JSON}`` (see :func:`tokenizer_spec_with`) is tokenizer ``BASE`` with special tokens
    added."""
    base, recipe = split_tokenizer_spec(spec)
    if recipe:
        return add_special_tokens(load_tokenizer(base), recipe, spec)
    if spec == "byte":
        return ByteTokenizer()
    fs, path = _find_tokenizer(spec)
    if fs.isdir(path):  # a Wav2Vec2 CTC tokenizer's directory
        return _load_ctc_tokenizer(spec, fs, path)
    with fs.open(path, "r", encoding="utf-8") as f:
        tokenizer_json = f.read()
    directory = posixpath.dirname(path)
    config = _tokenizer_config(fs, directory)
    # special tokens named only in special_tokens_map.json (older exports) count too
    named = _read_json_object(fs, posixpath.join(directory, "special_tokens_map.json"), missing_ok=True)
    config = {**{k: v for k, v in named.items() if k in SPECIAL_TOKEN_ROLES}, **config}
    return HfTokenizer(
        spec,
        tokenizer_json,
        _token_text(config.get("eos_token")),
        bos_token=_token_text(config.get("bos_token")),
        chat_template=_chat_template(fs, directory, config),
        config=config,
    )


def check_tokenizer_available(spec: str) -> None:
    """Raise :class:`DataError` (exit status 2) unless :func:`load_tokenizer` will find the
    files of tokenizer ``spec``, so that a missing tokenizer stops a run before it reads data
    or touches a device. A hub name missing from the Hugging Face cache is downloaded into it
    here when the hub is reachable; offline, the error says how to get it there."""
    spec = split_tokenizer_spec(spec)[0]
    if spec != "byte":
        _find_tokenizer(spec)


def find_tokenizer_json(spec: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and path of the ``tokenizer.json`` that ``spec`` (not ``byte``) names;
    for a hub name, in the Hugging Face cache's snapshot directory, beside the model's
    ``tokenizer_config.json``. Raises :class:`DataError` saying what to do if there is none
    (also for a Wav2Vec2 CTC tokenizer, which has none: :func:`load_tokenizer` rebuilds it)."""
    fs, path = _find_tokenizer(spec)
    if fs.isdir(path):
        raise DataError(
            f"data.tokenizer: {spec!r} is a {CTC_TOKENIZER_CLASS} (vocab.json, no tokenizer.json; looked in {path})"
        )
    return fs, path


def _find_tokenizer(spec: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and path of what defines tokenizer ``spec`` (not ``byte``): its
    ``tokenizer.json`` file, or the directory of a Wav2Vec2 CTC tokenizer (which has none).
    Raises :class:`DataError` saying what to do if there is neither."""
    fs, path = filesystem(spec)
    from_hub = not fs.exists(path) and _is_hub_name(spec)
    if from_hub:
        fs, path = fsspec.filesystem("file"), _hub_snapshot(spec)
    if fs.isdir(path):
        json_path = posixpath.join(path, "tokenizer.json")
        if fs.isfile(json_path):
            return fs, json_path
        if _is_ctc_tokenizer(fs, path):
            return fs, path
        if from_hub:
            raise DataError(
                f"data.tokenizer: the Hugging Face hub model {spec!r} has no tokenizer.json (looked in {path}). "
                f"Download it with `hf download {spec} {' '.join(HUB_TOKENIZER_FILES[:2])}`; if the model has "
                "only a slow tokenizer (vocab.json and merges.txt, or tokenizer.model), convert it with "
                f"transformers (AutoTokenizer.from_pretrained({spec!r}).save_pretrained(DIR)) and set "
                "data.tokenizer to DIR"
            )
        raise DataError(
            f"data.tokenizer: the directory {spec!r} has no tokenizer.json (nor the vocab.json and "
            f"tokenizer_config.json of a {CTC_TOKENIZER_CLASS})"
        )
    if fs.isfile(path):
        return fs, path
    raise DataError(
        f"data.tokenizer: {spec!r} is neither 'byte', an existing tokenizer.json file or directory "
        "containing one, nor the name of a Hugging Face hub model"
    )


def _is_hub_name(spec: str) -> bool:
    """Whether ``spec`` can be a hub model id (``name`` or ``org/name``). A URL, or a name
    ending in ``.json`` (a tokenizer file that is not there), is not one."""
    if "://" in spec or spec.endswith(".json"):
        return False
    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def _hub_snapshot(name: str) -> str:
    """The directory of the Hugging Face cache holding the tokenizer files of hub model
    ``name`` at its main revision: downloaded when the hub is reachable (and
    ``HF_HUB_OFFLINE`` is not set), else the copy already in the cache."""
    try:
        return snapshot_download(name, allow_patterns=list(HUB_TOKENIZER_FILES))
    except LocalEntryNotFoundError as e:  # offline, or the hub unreachable, and nothing cached
        why = (
            "HF_HUB_OFFLINE is set"
            if constants.is_offline_mode()
            else f"the hub could not be reached ({type(e.__cause__ or e).__name__})"
        )
        raise DataError(
            f"data.tokenizer: {name!r} is not a local path, and the tokenizer of the Hugging Face hub model "
            f"{name!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and cannot be downloaded: "
            f"{why}. Fetch it on a machine with network access, into a Hugging Face cache that this one "
            f"reads (HF_HUB_CACHE): `hf download {name} {' '.join(HUB_TOKENIZER_FILES[:2])}` (for a "
            f"{CTC_TOKENIZER_CLASS}, which has no tokenizer.json: `hf download {name} "
            "vocab.json tokenizer_config.json special_tokens_map.json`); or set data.tokenizer to a local "
            "directory holding tokenizer.json and tokenizer_config.json"
        ) from None
    except RepositoryNotFoundError:  # also a gated or private model without access
        raise DataError(
            f"data.tokenizer: {name!r} is not a local path, and the Hugging Face hub has no model {name!r} "
            "that you can read (a private or gated model needs `hf auth login` and, for a gated one, its "
            "terms accepted on the hub)"
        ) from None
    except Exception as e:  # the hub's other HTTP errors, a proxy refusing...
        raise DataError(
            f"data.tokenizer: the tokenizer of the Hugging Face hub model {name!r} could not be fetched: {e}"
        ) from None
