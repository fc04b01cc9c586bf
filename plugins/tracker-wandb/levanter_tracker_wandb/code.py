"""Find the code a run was started from, as ``save_code`` saves it.

W&B's own code saving keeps only the main script, which for ``levanter train`` is a
console script inside the virtual environment: useless. So we sniff the git repository
of the working directory (or of the directory ``save_code`` names) and record its commit,
its remote, the files git knows about (tracked, plus untracked ones that are not
ignored: the code as it was, not the ``.venv``) and the uncommitted diff.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GitSnapshot:
    """The state of a git working tree when the run started."""

    root: str
    commit: str | None
    """``HEAD``'s sha, or None in a repository without commits."""
    remote_url: str | None
    files: tuple[str, ...]
    """Paths relative to ``root`` of the files git tracks or would track."""
    diff: str
    """``git diff HEAD``: uncommitted changes to tracked files ("" if none)."""


def snapshot(directory: str) -> GitSnapshot | None:
    """The git state of the repository containing ``directory``, or None (with a warning)
    when it is not inside a git working tree or git is not installed."""
    root = _git(directory, "rev-parse", "--show-toplevel")
    if root is None:
        logger.warning(
            "wandb save_code: %s is not inside a git repository; no code is saved "
            "(set save_code to the directory of your code, or to false)",
            os.path.abspath(directory),
        )
        return None
    listed = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard", strip=False) or ""
    files = tuple(sorted({f for f in listed.split("\0") if f and os.path.isfile(os.path.join(root, f))}))
    commit = _git(root, "rev-parse", "--verify", "--quiet", "HEAD")
    return GitSnapshot(
        root=root,
        commit=commit,
        remote_url=_git(root, "remote", "get-url", "origin"),
        files=files,
        diff=(_git(root, "diff", "HEAD", strip=False) or "") if commit else "",
    )


def _git(cwd: str, *args: str, strip: bool = True) -> str | None:
    """Output of ``git ARGS`` in ``cwd``, or None if it fails."""
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() if strip else done.stdout
