"""Small file helpers shared by the checkpointer, the trackers, the run record and the
config sections that name paths."""

from __future__ import annotations

import functools
import os


def write_text_atomically(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers (and a run killed mid-write) see either
    the old content or the new, never a truncated file."""
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


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
    from fsspec.core import split_protocol

    for link in url.split("::"):
        protocol, _ = split_protocol(link)
        if protocol and (problem := _filesystem_problem(protocol)):
            raise ValueError(problem)
    return url


@functools.lru_cache(maxsize=None)
def _filesystem_problem(protocol: str) -> str | None:
    """Why fsspec cannot open ``protocol://`` URLs here; None if it can."""
    import fsspec
    from fsspec.registry import known_implementations

    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        return f"fsspec has no filesystem for {protocol}:// URLs (is the protocol misspelled?)"
    except ImportError as e:
        package = known_implementations[protocol]["class"].split(".")[0]
        cause = e.__cause__ or e
        extra = _EXTRAS.get(package)
        install = f"pip install 'levanter-core[{extra}]' (or pip install {package})" if extra else f"pip install {package}"
        if isinstance(cause, ModuleNotFoundError) and (cause.name or "").split(".")[0] == package:
            return f"{protocol}:// paths need the {package} package, which is not installed: {install}"
        return f"{protocol}:// paths need the {package} package, which cannot be imported ({cause}); reinstall it: {install}"
    return None
