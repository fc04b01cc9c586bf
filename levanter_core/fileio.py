"""Small file helpers shared by the checkpointer, the trackers, the run record and the
config sections that name paths."""

from __future__ import annotations

import contextlib
import functools
import os
import posixpath
import shutil
from typing import Any

import fsspec
import fsspec.config
from fsspec.core import split_protocol
from fsspec.registry import known_implementations


def write_text_atomically(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers (and a run killed mid-write) see either
    the old content or the new, never a truncated file."""
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def new_file_mode() -> int:
    """The permissions a file created now gets by default: ``0o666`` less the process's umask
    (``0o644`` under the usual ``022``). For files a library writes owner-only (safetensors'
    shards) that others are meant to read, as an ordinary ``open`` would have made them."""
    try:
        with open("/proc/self/status") as f:  # Linux: read without changing it
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


# The levanter-core extra that installs a filesystem package, by package.
_EXTRAS = {"s3fs": "s3", "gcsfs": "gcs"}


def require_filesystem(url: str | None) -> str | None:
    """``url`` (a path or fsspec URL; None passes) unchanged if this environment can open
    it; else a ``ValueError`` saying why and what to install. For config validators of
    fields that name paths, so that a ``gs://`` checkpoint path without ``gcsfs`` stops
    the run when the config is loaded, naming its field, not minutes into training.

    Local paths always pass. A URL's protocol must be one fsspec knows, and the package
    implementing it importable: asked of fsspec's own registry (which imports it), once
    per protocol. A chained URL (``simplecache::s3://...``) is checked link by link."""
    if url is None:
        return url
    for link in url.split("::"):
        protocol, _ = split_protocol(link)
        if protocol and (problem := _filesystem_problem(protocol)):
            raise ValueError(problem)
    return url


@functools.cache
def _filesystem_problem(protocol: str) -> str | None:
    """Why fsspec cannot open ``protocol://`` URLs here; None if it can."""
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        return f"fsspec has no filesystem for {protocol}:// URLs (is the protocol misspelled?)"
    except ImportError as e:
        package = known_implementations[protocol]["class"].split(".")[0]
        cause = e.__cause__ or e
        extra = _EXTRAS.get(package)
        install = (
            f"pip install 'levanter-core[{extra}]' (or pip install {package})" if extra else f"pip install {package}"
        )
        if isinstance(cause, ModuleNotFoundError) and (cause.name or "").split(".")[0] == package:
            return f"{protocol}:// paths need the {package} package, which is not installed: {install}"
        return f"{protocol}:// paths need the {package} package, which cannot be imported ({cause}); reinstall it: {install}"
    return None


# -- object stores ------------------------------------------------------------------------------
#
# A path is local (a plain path or file://) or a URL of an object store (s3://, gs://) or of any
# other fsspec filesystem. Arrays go through TensorStore (kvstore_spec), everything else through
# fsspec (filesystem). Where to reach S3 and with which credentials comes from the environment
# (AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID...), which the ``storage:`` section of a
# config can fill in (StorageConfig.apply); both libraries, and every process the run starts,
# read it from there.

OBJECT_STORES = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
"""URL protocols of object stores -> the store (``s3`` or ``gcs``)."""


def protocol_of(path: str) -> str | None:
    """``s3`` for ``s3://bucket/key``; None for a local path (``file://`` included)."""
    protocol, sep, _ = str(path).partition("://")
    if not sep or protocol == "file" or "/" in protocol:
        return None
    return protocol


def is_local(path: str) -> bool:
    return protocol_of(path) is None


def local_path(path: str) -> str:
    """The absolute local path of a plain path or ``file://`` URL."""
    path = str(path)
    if path.startswith("file://"):
        path = path[len("file://") :]
    return os.path.abspath(os.path.expanduser(path))


def normalize(path: str) -> str:
    """A local path made absolute; a URL without trailing slashes."""
    return local_path(path) if is_local(path) else str(path).rstrip("/")


def join(base: str, *parts: str) -> str:
    """``base/part/...``, with ``/`` for URLs and the OS separator for local paths."""
    if is_local(base):
        return os.path.join(base, *parts)
    return "/".join([str(base).rstrip("/"), *parts])


def _s3_endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def _s3_region() -> str | None:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None


def configure_fsspec() -> None:
    """Give fsspec's S3 filesystem the endpoint and region of the environment (s3fs itself does
    not read ``AWS_ENDPOINT_URL``); called before every filesystem is made, so that it follows
    the environment of the moment."""
    options: dict = {}
    if endpoint := _s3_endpoint():
        options["endpoint_url"] = endpoint
    if region := _s3_region():
        options["client_kwargs"] = {"region_name": region}
    if os.environ.get(_S3_ANONYMOUS) == "1":
        options["anon"] = True
    if options:
        fsspec.config.conf["s3"] = options
    else:
        fsspec.config.conf.pop("s3", None)
    if os.environ.get(_GCS_ANONYMOUS) == "1":
        fsspec.config.conf["gcs"] = {"token": "anon"}
    else:
        fsspec.config.conf.pop("gcs", None)


def filesystem(path: str):
    """fsspec's filesystem for ``path`` and the path within it."""
    configure_fsspec()
    if is_local(path):
        return fsspec.filesystem("file"), local_path(path)
    return fsspec.core.url_to_fs(str(path))


def open_file(url: str, mode: str = "rb", **options):
    """``fsspec.open`` with the environment's object-store settings."""
    configure_fsspec()
    return fsspec.open(url, mode, **options)


def kvstore_spec(path: str) -> dict[str, Any] | None:
    """TensorStore's kvstore spec for the directory ``path`` (ending in ``/``): the ``file``
    driver for a local path, ``s3`` and ``gcs`` for buckets (with the environment's endpoint,
    region and credentials); None for a URL that TensorStore has no driver for."""
    protocol = protocol_of(path)
    if protocol is None:
        return {"driver": "file", "path": local_path(path).rstrip("/") + "/"}
    store = OBJECT_STORES.get(protocol)
    if store is None:
        return None
    bucket, _, key = str(path).split("://", 1)[1].partition("/")
    spec: dict[str, Any] = {"driver": store, "bucket": bucket, "path": key.strip("/") + "/" if key.strip("/") else ""}
    if store == "s3":
        if endpoint := _s3_endpoint():
            spec["endpoint"] = endpoint
        spec["aws_region"] = _s3_region() or "us-east-1"
        if os.environ.get(_S3_ANONYMOUS) == "1":
            spec["aws_credentials"] = {"type": "anonymous"}
        elif os.environ.get("AWS_ACCESS_KEY_ID"):
            # "default" also reads ~/.aws, and logs an error for each file that is absent
            spec["aws_credentials"] = {"type": "environment"}
    return spec


def read_bytes(path: str) -> bytes:
    """The content of the file or object ``path``; FileNotFoundError if there is none."""
    if is_local(path):
        with open(local_path(path), "rb") as f:
            return f.read()
    fs, inner = filesystem(path)
    return fs.cat_file(inner)


def write_text(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` so that a reader sees the old content or the new, never
    part of it: locally through a renamed temporary file, on an object store in one put (an
    object is replaced atomically)."""
    if is_local(path):
        write_text_atomically(local_path(path), text)
    else:
        fs, inner = filesystem(path)
        fs.pipe_file(inner, text.encode("utf-8"))


def write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to the file or object ``path`` (creating local parent directories)."""
    if is_local(path):
        target = local_path(path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(data)
    else:
        fs, inner = filesystem(path)
        fs.pipe_file(inner, data)


def exists(path: str) -> bool:
    fs, inner = filesystem(path)
    if not is_local(path):
        fs.invalidate_cache(inner)  # s3fs and gcsfs answer from cached listings
    return fs.exists(inner)


def list_names(path: str) -> list[str]:
    """The names directly under the directory (or prefix) ``path``; [] if there is none."""
    if is_local(path):
        directory = local_path(path)
        return os.listdir(directory) if os.path.isdir(directory) else []
    fs, inner = filesystem(path)
    try:
        entries = fs.ls(inner, detail=False, refresh=True)
    except FileNotFoundError:
        return []
    return [posixpath.basename(entry.rstrip("/")) for entry in entries if entry.rstrip("/") != inner.rstrip("/")]


def remove_tree(path: str) -> None:
    """Delete the directory or prefix ``path`` and all under it (nothing if absent)."""
    if is_local(path):
        shutil.rmtree(local_path(path), ignore_errors=True)
        return
    fs, inner = filesystem(path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(inner, recursive=True)


def move_tree(source: str, destination: str) -> None:
    """Move a directory: a rename locally; on an object store, a copy of every object and then
    their deletion."""
    if is_local(source):
        os.rename(local_path(source), local_path(destination))
        return
    fs, inner = filesystem(source)
    _, target = filesystem(destination)
    fs.copy(inner, target, recursive=True)
    fs.rm(inner, recursive=True)


_S3_ANONYMOUS = "LEVANTER_S3_ANONYMOUS"
_GCS_ANONYMOUS = "LEVANTER_GCS_ANONYMOUS"
