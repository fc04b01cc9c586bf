"""Reading and writing Hugging Face checkpoint directories (``*.safetensors`` shards and
their index).

Reading inspects every shard's header before any data is loaded, so that a truncated
shard, a tensor the index promises but no shard holds, or a shard that cannot be parsed
are all known up front and can be reported together with any shape mismatch.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import struct
from collections.abc import Iterable

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from levanter_core.errors import CheckpointError
from levanter_core.fileio import filesystem, new_file_mode, write_text_atomically

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors' dtype names -> NumPy dtype names (bfloat16 comes from ml_dtypes, via JAX)
_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor as a shard's header describes it."""

    name: str
    """Its name in the shard (which :meth:`HfCheckpoint.with_base_model_prefix` may have
    changed in ``HfCheckpoint.tensors``)."""
    shape: tuple[int, ...]
    dtype: str
    """NumPy's name for it (``float32``, ``bfloat16``, ...)."""
    file: str


class HfCheckpoint:
    """The tensors of a Hugging Face checkpoint directory, found from its headers.

    ``tensors`` maps each readable tensor's name to its description; ``damaged`` maps a
    tensor that cannot be read (its shard is truncated or missing, or does not hold it) to
    the reason."""

    def __init__(self, directory: str):
        self.directory = directory
        self.tensors: dict[str, StoredTensor] = {}
        self.damaged: dict[str, str] = {}
        for file, promised in self._shards().items():
            self._scan(file, promised)

    def _shards(self) -> dict[str, set[str]]:
        """Each shard file -> the tensor names the index says it holds (empty without an index)."""
        index = os.path.join(self.directory, INDEX_FILE)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from None
            shards: dict[str, set[str]] = {}
            for name, file in weight_map.items():
                shards.setdefault(file, set()).add(name)
            return shards
        if os.path.isfile(os.path.join(self.directory, SINGLE_FILE)):
            return {SINGLE_FILE: set()}
        found = sorted(f for f in os.listdir(self.directory) if f.endswith(".safetensors"))
        if found:
            return {f: set() for f in found}
        others = [f for f in os.listdir(self.directory) if f.endswith((".bin", ".pt", ".pth"))]
        hint = (
            f" It has PyTorch pickles ({', '.join(sorted(others))}); re-save the model with "
            "`save_pretrained(..., safe_serialization=True)`."
            if others
            else ""
        )
        raise CheckpointError(
            f"{self.directory} holds no safetensors weights (no {INDEX_FILE} or *.safetensors).{hint}"
        )

    def _scan(self, file: str, promised: set[str]) -> None:
        path = os.path.join(self.directory, file)
        try:
            header, data_start, size = _read_header(path)
        except (OSError, ValueError) as e:
            for name in promised or {f"(every tensor of {file})"}:
                self.damaged[name] = f"shard {file} cannot be read: {e}"
            return
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            _begin, end = entry["data_offsets"]
            dtype = _DTYPES.get(entry["dtype"], entry["dtype"])
            self.tensors[name] = StoredTensor(name, tuple(entry["shape"]), dtype, file)
            if data_start + end > size:
                self.damaged[name] = (
                    f"shard {file} is truncated: it has {size} bytes, this tensor ends at byte {data_start + end}"
                )
        for name in promised - header.keys():
            self.damaged[name] = f"the index puts it in {file}, which does not hold it"

    def read(self, name: str) -> np.ndarray:
        """The tensor's values (a NumPy array in its stored dtype)."""
        stored = self.tensors[name]
        with safe_open(os.path.join(self.directory, stored.file), framework="np") as f:
            return f.get_tensor(stored.name)

    def with_base_model_prefix(self, expected: Iterable[str]) -> HfCheckpoint:
        """This checkpoint with the prefix that ``expected`` (the model's tensor names) puts
        before every name (``transformer.``, ``model.``) added to its own names, if it was
        saved without it; else this checkpoint.

        ``transformers`` saves the base model of a family (``GPT2Model`` rather than
        ``GPT2LMHeadModel``) without the prefix, and loads either way: so does the original
        ``gpt2`` checkpoint on the hub, whose tensors are ``wte.weight``, ``h.0.ln_1.weight``..."""
        prefixes = {name.split(".", 1)[0] for name in expected if "." in name}
        names = self.tensors.keys() | self.damaged.keys()
        for prefix in sorted(prefixes):
            if any(n.startswith(prefix + ".") for n in names):
                continue
            if any(f"{prefix}.{n}" in expected for n in names):
                view = copy.copy(self)
                view.tensors = {f"{prefix}.{n}": t for n, t in self.tensors.items()}
                view.damaged = {f"{prefix}.{n}": why for n, why in self.damaged.items()}
                return view
        return self


def _read_header(path: str) -> tuple[dict, int, int]:
    """A safetensors file's JSON header, where its data starts, and the file's size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"only {size} bytes, not even a header length")
        (length,) = struct.unpack("<Q", prefix)
        if 8 + length > size:
            raise ValueError(f"truncated: {size} bytes, but the header alone claims {8 + length}")
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise ValueError(f"header is not valid JSON ({e})") from None
    return header, 8 + length, size


def write_hf_checkpoint(directory: str, tensors: dict[str, np.ndarray], *, max_shard_bytes: int) -> list[str]:
    """Write ``tensors`` as ``model-0000i-of-0000n.safetensors`` shards of at most
    ``max_shard_bytes`` (a tensor larger than that gets a shard of its own) and the index
    ``model.safetensors.index.json``, readable as the umask allows (``0o644`` usually). Returns
    the shard file names."""
    groups: list[list[str]] = [[]]
    group_bytes = 0
    for name, array in tensors.items():
        if groups[-1] and group_bytes + array.nbytes > max_shard_bytes:
            groups.append([])
            group_bytes = 0
        groups[-1].append(name)
        group_bytes += array.nbytes
    files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for file, names in zip(files, groups):
        path = os.path.join(directory, file)
        save_file({n: np.ascontiguousarray(tensors[n]) for n in names}, path, metadata={"format": "pt"})
        os.chmod(path, new_file_mode())  # safetensors makes it its owner's alone; the export is for everyone
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))}, "weight_map": weight_map}
    write_text_atomically(os.path.join(directory, INDEX_FILE), json.dumps(index, indent=2) + "\n")
    return files


def upload_hf_directory(local: str, url: str) -> None:
    """Copy the Hugging Face model directory ``local`` to the object-store URL ``url`` (e.g.
    ``s3://bucket/exports/step-100``) so that a reader never takes an upload in progress for a
    whole model: the weights' entry point of an earlier export there (``INDEX_FILE`` or
    ``SINGLE_FILE``, without which ``transformers`` finds no weights) is deleted first, and this
    export's is uploaded last, after the config, the tokenizer files and every shard."""
    fs, root = filesystem(url)
    root = root.rstrip("/")
    for name in (INDEX_FILE, SINGLE_FILE):
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(f"{root}/{name}")
    files = sorted(
        os.path.relpath(os.path.join(directory, name), local)
        for directory, _, names in os.walk(local)
        for name in names
    )
    last = [f for f in (INDEX_FILE, SINGLE_FILE) if f in files]
    for relative in [f for f in files if f not in last] + last:
        fs.put_file(os.path.join(local, relative), f"{root}/{relative.replace(os.sep, '/')}")
