"""Small file helpers shared by the checkpointer, the trackers and the run record."""

from __future__ import annotations

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
