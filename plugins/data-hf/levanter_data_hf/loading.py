"""Loading Hugging Face datasets for ``type: hf``: everything here imports ``datasets`` (and
with it pyarrow and pandas, about a second), so :mod:`levanter_data_hf.source` imports this
module only when a dataset is first read, and a run whose data is not ``type: hf`` never does.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
from typing import Any

import datasets
from datasets import Audio, LargeList, List
from datasets.data_files import EmptyDatasetError
from datasets.exceptions import DatasetBuildError, DatasetsError
from pyarrow import ArrowException

from levanter_core.errors import DataError

# Files that `save_to_disk` writes: one of them marks a directory to read with `load_from_disk`.
_SAVED_MARKERS = ("dataset_dict.json", "state.json")

READ_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, ArrowException, DatasetsError)
"""What reading rows raises on unreadable input."""


def is_dataset(ds: Any) -> bool:
    """Whether ``ds`` is a prepared ``Dataset`` (Arrow files), not a stream."""
    return isinstance(ds, datasets.Dataset)


def data_files(id: str, name: str | None, revision: str | None, files: Any, split: str) -> list:
    """The data files that ``load_dataset`` reads for ``split``, with their origin metadata."""
    builder = datasets.load_dataset_builder(id, name, revision=revision, data_files=files)
    split_files = (builder.config.data_files or {}).get(split, [])
    metadata = getattr(split_files, "origin_metadata", None) or [()] * len(split_files)
    return list(zip(split_files, metadata))


@functools.lru_cache(maxsize=8)
def load(id: str, name: str | None, revision: str | None, data_files_json: str, stream: bool) -> dict[str, Any]:
    """A dataset's splits by name (``Dataset`` s, or ``IterableDataset`` s when streaming a
    hub or file dataset), loaded once per process, with their audio undecoded; the arguments
    are the config's loading fields."""
    if _is_saved(id):
        splits = _load_saved(id, name, revision, data_files_json)
    else:
        splits = _load_with_datasets(id, name, revision, json.loads(data_files_json), stream)
    return {split: _audio_undecoded(ds) for split, ds in splits.items()}


def _audio_undecoded(ds):
    """``ds`` reading every ``Audio`` feature as ``{"bytes": ..., "path": ...}`` instead of
    decoding it; ``ds`` itself when it has none (or its features are unknown)."""
    features = ds.features
    undecoded = _without_audio_decoding(features) if features else features
    if undecoded == features:
        return ds
    if isinstance(ds, datasets.IterableDataset):
        # decode(False) also removes the threaded decoding that load_dataset puts on a hub
        # stream with media; the cast gives any other media feature its decoding back.
        return ds.decode(False).cast(undecoded)
    # A Dataset decodes what its features say, and a deep copy shares the Arrow table: the
    # copy keeps the fingerprint (existing caches stay valid), the format and the cache
    # files. cast_column does just this for a top-level column, but for Audio inside a
    # struct or a list it casts the whole table into a new Arrow file (beside a saved
    # dataset, in its directory).
    copied = copy.deepcopy(ds)
    copied.info.features = undecoded
    return copied


def _without_audio_decoding(feature):
    """``feature`` with every ``Audio`` in it, at any depth, set to ``decode=False``."""
    if isinstance(feature, Audio):
        return dataclasses.replace(feature, decode=False)
    if isinstance(feature, dict):  # Features, or a struct
        return type(feature)({key: _without_audio_decoding(value) for key, value in feature.items()})
    if isinstance(feature, (List, LargeList)):
        return dataclasses.replace(feature, feature=_without_audio_decoding(feature.feature))
    return feature


def _is_saved(id: str) -> bool:
    """Whether ``id`` is a directory written by ``save_to_disk``."""
    return os.path.isdir(id) and any(os.path.isfile(os.path.join(id, marker)) for marker in _SAVED_MARKERS)


def _load_saved(id: str, name: str | None, revision: str | None, data_files_json: str) -> dict[str, Any]:
    for field, value in (("name", name), ("revision", revision), ("data_files", json.loads(data_files_json))):
        if value is not None:
            raise DataError(
                f"{field}: {id!r} was written by save_to_disk and has no {field}; remove {field} ({value!r})"
            )
    loaded = datasets.load_from_disk(id)
    if isinstance(loaded, datasets.Dataset):
        return {"train": loaded}
    return dict(loaded)


def _load_with_datasets(id: str, name: str | None, revision: str | None, data_files, stream: bool) -> dict[str, Any]:
    local = _looks_local(id)
    if local and not os.path.isdir(id):
        raise DataError(f"no dataset {id!r}: no such directory")
    try:
        loaded = datasets.load_dataset(id, name, revision=revision, data_files=data_files, streaming=stream)
    except ValueError as e:
        if name is not None and "BuilderConfig" in str(e):
            known = _config_names(id, revision, e)
            raise DataError(f"name: dataset {id!r} has no configuration {name!r}; {known}") from None
        raise DataError(f"dataset {id!r}: cannot load it ({e})") from None
    except EmptyDatasetError as e:
        raise DataError(f"dataset {id!r}: no data files found ({e})") from None
    except (FileNotFoundError, ConnectionError) as e:
        if local:
            raise DataError(f"dataset {id!r}: cannot load it ({e})") from None
        offline = " (offline: hub ids need network; HF_HUB_OFFLINE is set)" if datasets.config.HF_HUB_OFFLINE else ""
        raise DataError(
            f"no dataset {id!r}: not a local directory, nor a hub dataset this machine can reach or has cached{offline}"
        ) from None
    except DatasetBuildError as e:
        raise DataError(f"dataset {id!r}: cannot prepare it ({e.__cause__ or e})") from None
    if not isinstance(loaded, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        return {"train": loaded}
    return dict(loaded)


def _looks_local(id: str) -> bool:
    """Whether ``id`` names a path rather than a hub id (``name`` or ``org/name``)."""
    return os.path.exists(id) or id.startswith(("/", ".", "~")) or id.count("/") > 1


def _config_names(id: str, revision: str | None, error: ValueError) -> str:
    try:
        names = datasets.get_dataset_config_names(id, revision=revision)
    except Exception:  # listing needs what loading needed; fall back to datasets' own message
        return str(error)
    return f"it has: {', '.join(names)}"
