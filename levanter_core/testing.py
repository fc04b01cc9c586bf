"""Helpers for testing plugins against the core (used by the plugins' own test suites)."""

from __future__ import annotations

import os
from typing import Iterable


def train_briefly(config_path: str, workdir: str, *, steps: int = 4, overrides: list[str] = ()):
    """Train the config at ``config_path`` for ``steps`` steps in-process, with its data,
    logs, checkpoints and cache under ``workdir`` and a small slice of the Python
    standard library as the corpus (so it runs offline in seconds). Returns the
    :class:`~levanter_core.trainer.run.RunResult`."""
    from levanter_core.config.train import load_train_config
    from levanter_core.trainer.run import run_training

    args = [
        "--trainer.num_train_steps", str(steps),
        "--trainer.steps_per_eval", str(steps),
        "--trainer.max_eval_batches", "1",
        "--trainer.log_dir", os.path.join(workdir, "logs"),
        "--trainer.checkpointer.base_path", os.path.join(workdir, "checkpoints"),
        "--data.cache_dir", os.path.join(workdir, "cache"),
        "--data.max_files", "20",
        *overrides,
    ]  # fmt: skip
    config, _ = load_train_config(config_path, args)
    return run_training(config, config_path=config_path, progress=False)


def train_bpe_tokenizer(
    texts: Iterable[str], path: str, *, vocab_size: int, special_tokens: tuple[str, ...] = ("<|endoftext|>",)
) -> str:
    """Train a byte-level BPE tokenizer on ``texts`` with the ``tokenizers`` library (offline,
    in seconds for small corpora) and save it as the ``tokenizer.json`` at ``path``. Returns
    ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(path)
    return path
