"""Logging from inside jit-compiled code, without a host sync on every step.

Code that runs inside the training step (a model's forward pass, a loss, an
optimizer) calls :func:`jit_log` with scalar arrays::

    from levanter_core.tracker import jit_log

    def __call__(self, x):
        ...
        jit_log({"attn/max_logit": hax.max(logits).array})

The values become outputs of the compiled step, next to ``train/loss``. The
training loop fetches a step's outputs only after the next step has been
dispatched, so logging adds no synchronization: the values reach the trackers
with the step's other metrics. Values logged during the loss computation are
averaged over microbatches like the loss.

Logging happens while the step is *traced*: a call outside a step being traced
is ignored, and a value computed inside a ``jax.lax.scan`` body (layers
stacked with ``hnn.Stacked``, say) cannot leave the scan this way; return it
from the scan instead.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp

_collectors = threading.local()


def jit_log(metrics: dict[str, Any]) -> None:
    """Add ``metrics`` (name -> scalar array or number) to the outputs of the step being
    traced. A name logged twice in one step keeps the last value."""
    stack = getattr(_collectors, "stack", None)
    if not stack:
        return
    for name, value in metrics.items():
        value = jnp.asarray(value, dtype=jnp.float32)
        if value.shape != ():
            raise ValueError(f"jit_log: {name!r} should be a scalar, got an array of shape {value.shape}")
        stack[-1][name] = value


@contextlib.contextmanager
def collecting() -> Iterator[dict[str, Any]]:
    """Collect what :func:`jit_log` receives while the body is traced (used by the trainer)."""
    stack = getattr(_collectors, "stack", None)
    if stack is None:
        stack = _collectors.stack = []
    logged: dict[str, Any] = {}
    stack.append(logged)
    try:
        yield logged
    finally:
        stack.pop()
