"""The ``storage:`` section: how to reach object stores (``s3://``, ``gs://``), and the check,
when a config is loaded, that every bucket it names can be reached.

Every path of a config (data, caches, checkpoints, run directories, exports) may be an
object-store URL. Where the store is and which credentials to use come from the usual
environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``,
``AWS_REGION``, ``AWS_PROFILE``, ``GOOGLE_APPLICATION_CREDENTIALS``...), or from this section,
which fills in the same variables for the run and every process it starts.
"""

from __future__ import annotations

import functools
import os
from typing import Annotated, Any

from pydantic import Field, PlainSerializer, SecretStr

from levanter_core.config.base import ConfigModel
from levanter_core.fileio import _GCS_ANONYMOUS, _S3_ANONYMOUS, OBJECT_STORES, protocol_of, require_filesystem

Secret = Annotated[SecretStr | None, PlainSerializer(lambda value: None)]
"""A credential: read from the config, never written back (a saved config holds null)."""


class S3StorageConfig(ConfigModel):
    """Amazon S3 and S3-compatible stores (MinIO, Ceph, R2, moto...). Each field left unset
    keeps what the environment says."""

    endpoint_url: str | None = None
    """The store's URL (``http://127.0.0.1:9000``), for a store that is not AWS: sets
    ``AWS_ENDPOINT_URL``."""
    region: str | None = None
    """The bucket's region (``us-east-1``): sets ``AWS_REGION``."""
    access_key_id: str | None = None
    """Sets ``AWS_ACCESS_KEY_ID``. Prefer the environment or ``AWS_PROFILE``: a config is saved
    with the run."""
    secret_access_key: Secret = None
    """Sets ``AWS_SECRET_ACCESS_KEY``. Never written to the run's saved config."""
    session_token: Secret = None
    """Sets ``AWS_SESSION_TOKEN`` (temporary credentials). Never written to the saved config."""
    profile: str | None = None
    """A profile of ``~/.aws/credentials``: sets ``AWS_PROFILE``."""
    anonymous: bool = False
    """Read public buckets without credentials."""


class GcsStorageConfig(ConfigModel):
    """Google Cloud Storage. Each field left unset keeps what the environment says."""

    credentials: str | None = None
    """A service-account or authorized-user JSON file: sets ``GOOGLE_APPLICATION_CREDENTIALS``.
    Unset: the environment's, gcloud's application-default credentials, or the machine's
    (on Google Cloud)."""
    project: str | None = None
    """The project billed for requests: sets ``GOOGLE_CLOUD_PROJECT``."""
    anonymous: bool = False
    """Read public buckets without credentials."""


class StorageConfig(ConfigModel):
    """How the run reaches object stores: ``s3`` (and S3-compatible stores) and ``gcs``. The
    filesystem packages come with ``pip install 'levanter-core[s3]'`` and ``[gcs]``."""

    s3: S3StorageConfig = Field(default_factory=S3StorageConfig)
    """``s3://`` paths."""
    gcs: GcsStorageConfig = Field(default_factory=GcsStorageConfig)
    """``gs://`` paths."""

    def environment(self) -> dict[str, str]:
        """The environment variables this section sets."""
        s3, gcs = self.s3, self.gcs
        values = {
            "AWS_ENDPOINT_URL": s3.endpoint_url,
            "AWS_REGION": s3.region,
            "AWS_ACCESS_KEY_ID": s3.access_key_id,
            "AWS_SECRET_ACCESS_KEY": s3.secret_access_key.get_secret_value() if s3.secret_access_key else None,
            "AWS_SESSION_TOKEN": s3.session_token.get_secret_value() if s3.session_token else None,
            "AWS_PROFILE": s3.profile,
            _S3_ANONYMOUS: "1" if s3.anonymous else None,
            "GOOGLE_APPLICATION_CREDENTIALS": os.path.expanduser(gcs.credentials) if gcs.credentials else None,
            "GOOGLE_CLOUD_PROJECT": gcs.project,
            _GCS_ANONYMOUS: "1" if gcs.anonymous else None,
        }
        return {name: value for name, value in values.items() if value is not None}

    def apply(self) -> None:
        """Set the variables in this process's environment, where TensorStore, fsspec and the
        processes the run starts (cache workers, Ray) read them."""
        changed = self.environment()
        if changed:
            os.environ.update(changed)
            _credentials_problem.cache_clear()


def object_store_urls(raw: Any, path: tuple = ()) -> list[tuple[tuple, str]]:
    """Every ``(location, url)`` in a raw config whose value is an object-store URL."""
    found = []
    if isinstance(raw, dict):
        for key, value in raw.items():
            found += object_store_urls(value, (*path, key))
    elif isinstance(raw, (list, tuple)):
        for i, value in enumerate(raw):
            found += object_store_urls(value, (*path, i))
    elif isinstance(raw, str) and protocol_of(raw) in OBJECT_STORES:
        found.append((path, raw))
    return found


def storage_problem(url: str) -> str | None:
    """Why the run could not reach ``url`` (a package or credentials missing); None if it can.
    Looks for credentials where the store's own client would, without contacting the store."""
    try:
        require_filesystem(url)
    except ValueError as e:
        return str(e)
    return _credentials_problem(OBJECT_STORES[protocol_of(url) or ""])


@functools.cache
def _credentials_problem(store: str) -> str | None:
    if store == "s3":
        return _s3_credentials_problem()
    return _gcs_credentials_problem()


def _s3_credentials_problem() -> str | None:
    if os.environ.get(_S3_ANONYMOUS) == "1":
        return None
    import botocore.session

    try:
        found = botocore.session.get_session().get_credentials()
    except Exception as e:  # a profile that is named but missing, an unreadable file...
        return f"its AWS credentials cannot be read: {e}"
    if found is None:
        return (
            "no AWS credentials were found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), "
            "or storage.s3.access_key_id and storage.s3.secret_access_key, or storage.s3.anonymous: true for a "
            "public bucket"
        )
    return None


def _gcs_credentials_problem() -> str | None:
    if os.environ.get(_GCS_ANONYMOUS) == "1":
        return None
    import google.auth
    import google.auth.exceptions

    try:
        google.auth.default()
    except google.auth.exceptions.DefaultCredentialsError:
        return (
            "no Google Cloud credentials were found: set "
            "GOOGLE_APPLICATION_CREDENTIALS or storage.gcs.credentials to a credentials file, run "
            "`gcloud auth application-default login`, or set storage.gcs.anonymous: true for a public bucket"
        )
    return None
