"""A run's identity and its record: the run id (the same command names the same run, so it
resumes), and what is written to the run directory before training (``config.yaml``,
``run.json``: versions, plugins, the code's git commit)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from typing import Any

import jax
import yaml
from pydantic import BaseModel

from levanter_core import __version__, distributed
from levanter_core.config.train import TrainConfig
from levanter_core.errors import ConfigError
from levanter_core.fileio import write_text_atomically


def resolved_config(config: TrainConfig) -> dict:
    """The config with every default filled in, as JSON-able data."""
    return config.model_dump(mode="json")


def derive_run_id(config: TrainConfig, config_path: str | None) -> str:
    """``trainer.id`` if set; else ``{config file stem}-{hash of the resolved config}``, so the
    same command (same config, same overrides) names the same run and resumes it."""
    if config.trainer.id:
        return config.trainer.id
    stem = os.path.splitext(os.path.basename(config_path))[0] if config_path else "run"
    return f"{stem}-{config_digest(config)[:8]}"


def config_digest(config: TrainConfig) -> str:
    """A hash of the config without what may differ between the processes of one run or
    between attempts at it (``trainer.id``, ``trainer.distributed``). Only what differs from
    the defaults counts (and every section's ``type``), so a release that adds a field with a
    default leaves the run ids of existing configs, and so their resumption, as they were."""
    data = _non_defaults(config)
    data.get("trainer", {}).pop("id", None)
    data.get("trainer", {}).pop("distributed", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def _non_defaults(value: Any) -> Any:
    """``value`` (a config, or a value inside one) as JSON-able data, leaving out every field
    that has its default, except ``type`` (which says what the rest means)."""
    if isinstance(value, BaseModel):
        out = {}
        for name, field in type(value).model_fields.items():
            current = getattr(value, name)
            if name != "type" and not field.is_required() and current == field.get_default(call_default_factory=True):
                continue
            out[name] = _non_defaults(current)
        return out
    if isinstance(value, (list, tuple)):
        return [_non_defaults(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _non_defaults(v) for k, v in value.items()}
    return value


def agreed_run_id(config: TrainConfig, config_path: str | None) -> str:
    """The run id, the same in every process: process 0's. Raises :class:`ConfigError` in a
    process whose config differs from process 0's (a run's processes must all be started with
    the same config and overrides; only ``trainer.distributed`` may differ)."""
    run_id, digest = derive_run_id(config, config_path), config_digest(config)
    if distributed.process_count() == 1:
        return run_id
    leader = json.loads(distributed.share("run", json.dumps({"run_id": run_id, "digest": digest})))
    verdicts = distributed.gather("run_config_matches", str(leader["digest"] == digest))
    # Process 0 learns which processes differ; a process that differs knows it itself.
    differing = [i for i, same in enumerate(verdicts or []) if same != "True"]
    if leader["digest"] != digest:
        differing = [distributed.process_index()]
    if differing:
        who = f"process {differing[0]} was" if len(differing) == 1 else f"processes {differing} were"
        raise ConfigError(
            f"{who} started with a config that differs from process 0's. Start every process of a run with "
            "the same config file and overrides; only trainer.distributed (process_id, local_device_ids) may differ."
        )
    return leader["run_id"]


def _git_state(directory: str) -> dict | None:
    """The commit checked out in the git repository holding ``directory``, and whether the
    working tree differs from it; None outside a repository (or without git)."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    if not sha:
        return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"sha": sha, "dirty": bool(status), "root": git("rev-parse", "--show-toplevel")}


def write_run_record(run_dir: str, resolved: dict, config_path: str | None, plugins: dict) -> list[str]:
    """Save the resolved config (``config.yaml``), the code version (``run.json``: git commit of
    the working directory and of levanter itself, versions of every plugin) and the installed
    packages (``requirements.txt``, in ``pip freeze`` form) in the run directory; return the
    three paths."""
    os.makedirs(run_dir, exist_ok=True)
    config_file = os.path.join(run_dir, "config.yaml")
    write_text_atomically(config_file, yaml.safe_dump(resolved, sort_keys=False))
    record = {
        "config_file": os.path.abspath(config_path) if config_path else None,
        "command": sys.argv,
        "working_directory": os.getcwd(),
        "git": _git_state(os.getcwd()),
        "levanter_core": __version__,
        "levanter_core_git": _git_state(os.path.dirname(os.path.abspath(__file__))),
        "plugins": plugins,
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "processes": jax.process_count(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    record_file = os.path.join(run_dir, "run.json")
    write_text_atomically(record_file, json.dumps(record, indent=2))
    packages = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions())
    requirements = os.path.join(run_dir, "requirements.txt")
    write_text_atomically(requirements, "\n".join(packages) + "\n")
    return [config_file, record_file, requirements]
