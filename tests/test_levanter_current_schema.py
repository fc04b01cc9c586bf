"""Levanter's current config schema (marin-community/marin, ``lib/levanter``): the names its
configs use today load here and mean what they mean in Levanter. The configs are written here
from what Levanter's source says each field does."""

from __future__ import annotations

import pytest
import tensorstore as ts
import yaml

from conftest import code_docs, run_config, write_jsonl
from levanter_core.config.train import load_train_config
from levanter_core.errors import ConfigError
from levanter_core.run import run_training
from levanter_core.testing import MODEL

CONTEXT = {k: v for k, v in MODEL.items() if k != "seq_len"}
"""The tiny GPT-2 without its context, which each case gives as Levanter does."""


def _config(tmp_path, **top) -> str:
    """A run config whose model section and top-level fields are ``top``'s (``model`` merged
    into the tiny GPT-2), on a few small documents."""
    data = {
        "train_urls": [write_jsonl(tmp_path / "train.jsonl", code_docs(60))],
        "validation_urls": [write_jsonl(tmp_path / "validation.jsonl", code_docs(10, offset=100))],
        "cache_dir": str(tmp_path / "cache"),
    }
    path = run_config(tmp_path, data, model={**CONTEXT, **top.pop("model", {})}, steps=2)
    raw = yaml.safe_load(open(path))
    raw.update(top)
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    return path


@pytest.mark.parametrize("spelling", ["train_seq_len", "train_length", "train_seq_length"])
def test_max_seq_len_is_the_models_context_and_train_seq_len_the_trained_length(tmp_path, spelling):
    config, _ = load_train_config(_config(tmp_path, model={"max_seq_len": 64}, **{spelling: 32}))
    assert (config.model.seq_len, config.train_seq_len, config.train_length) == (64, 32, 32)


def test_without_train_seq_len_the_run_trains_on_the_models_whole_context(tmp_path):
    config, _ = load_train_config(_config(tmp_path, model={"max_seq_len": 48}))
    assert (config.model.seq_len, config.train_seq_len, config.train_length) == (48, None, 48)


@pytest.mark.parametrize(
    ("top", "message"),
    [
        ({"model": {"max_seq_len": 32}, "train_seq_len": 64}, r"train_seq_len \(64\) cannot exceed the model's context"),
        ({"model": {"max_seq_len": 64, "seq_len": 32}}, r"max_seq_len \(64\) and seq_len \(32\) name the same field"),
        ({"model": {"max_seq_len": 0}}, "max_seq_len: expected a positive number of tokens"),
        ({"model": {"max_seq_len": 32}, "train_seq_len": 0}, "train_seq_len"),
    ],
)
def test_lengths_that_do_not_fit_are_refused_by_name(tmp_path, top, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(_config(tmp_path, **top))


def test_a_shorter_training_length_trains_the_first_positions_and_keeps_the_whole_context(tmp_path):
    """GPT-2 learns its position embeddings: a model of context 64 trained on 32-token sequences
    keeps all 64 rows (its checkpoints and exports are of the 64-token model), and only rows the
    32-token sequences reach are trained: Adam's first moment is 0 from row 31 on (the last
    position of a sequence predicts nothing, and under causal attention nothing before it sees it)."""
    path = _config(tmp_path, model={"max_seq_len": 64}, train_seq_len=32)
    config, _ = load_train_config(path)
    result = run_training(config, config_path=path, progress=False)
    assert result.final_step == 2 and result.final_eval_loss is not None

    def read(name: str):
        spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": f"{result.checkpoint}/{name}"}}
        return ts.open(spec).result().read().result()

    weights = read("model/embeddings/position_embeddings/weight")
    first_moment = read("opt_state/1/mu/embeddings/position_embeddings/weight")
    assert weights.shape[0] == 64
    assert (first_moment[:31] != 0).any(axis=1).all()
    assert not first_moment[31:].any()
