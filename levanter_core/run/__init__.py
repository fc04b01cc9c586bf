"""The application: what ``levanter train`` does with a config, step by step.

    setup (preflight, JAX, processes) -> record (run id, run directory) -> initial (model,
    objective, first state) -> loop (steps) + callbacks (side work between steps)
    -> export -> result

:func:`run_training` (:mod:`levanter_core.run.train`) reads as that list. The library below
(models, layers, data, checkpoints, trackers, the compiled step in
:mod:`levanter_core.trainer.trainer`) never imports this package.
"""

from levanter_core.run.record import agreed_run_id, config_digest, derive_run_id, resolved_config, write_run_record
from levanter_core.run.result import RunResult
from levanter_core.run.setup import configure_jax, levanter_differences, preflight
from levanter_core.run.train import run_training

__all__ = [
    "RunResult",
    "agreed_run_id",
    "config_digest",
    "configure_jax",
    "derive_run_id",
    "levanter_differences",
    "preflight",
    "resolved_config",
    "run_training",
    "write_run_record",
]
