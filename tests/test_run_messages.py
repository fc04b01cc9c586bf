"""What a run says and leaves behind in the small cases a new user meets: a finished run run
again, a run on the CPU, a run that bad data stops before its first step."""

import logging

import pytest

from levanter_core.config.train import load_train_config
from levanter_core.errors import DataError
from levanter_core.run import levanter_differences, run_training
from levanter_core.testing import code_docs, run_config, write_jsonl


def test_a_finished_run_run_again_saves_nothing_and_says_so_once(tmp_path, capsys, caplog):
    data = {"train_urls": [write_jsonl(tmp_path / "train.jsonl", code_docs(40))], "cache_dir": str(tmp_path / "cache")}
    path = run_config(tmp_path, data, run_id="again", steps=2, steps_per_eval=100)
    config, _ = load_train_config(path)
    run_training(config, progress=False)
    capsys.readouterr()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="levanter_core"):
        result = run_training(config, progress=False)
    said = capsys.readouterr().out + "\n".join(r.getMessage() for r in caplog.records)
    assert result.final_step == 2 and "run already complete: step 2 of 2" in said
    # neither "discarding this save" nor "saved permanent checkpoint": there was nothing to save
    assert "discarding" not in said and "saved" not in said, said
    assert sorted(p.name for p in (tmp_path / "ckpt" / "again").iterdir() if p.name.startswith("step-")) == ["step-2"]


def test_the_cpu_note_does_not_read_as_if_this_run_needed_an_accelerator(tmp_path):
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("the note is for CPU runs")
    data = {"train_urls": [write_jsonl(tmp_path / "train.jsonl", code_docs(4))]}
    config, _ = load_train_config(run_config(tmp_path, data))
    [note] = [n for n in levanter_differences(config) if "CPU" in n]
    assert "this run trains on the CPU, which it may" in note and "require_accelerator" in note
    assert "would require a GPU or TPU here" not in note


def test_bad_data_leaves_no_run_directory_behind(tmp_path):
    data = {"train_urls": [write_jsonl(tmp_path / "bad.jsonl", [{"content": "no text field"}] * 4)],
            "cache_dir": str(tmp_path / "cache")}  # fmt: skip
    config, _ = load_train_config(run_config(tmp_path, data, run_id="bad", steps=2))
    with pytest.raises(DataError, match="no 'text' field"):
        run_training(config, progress=False)
    assert not (tmp_path / "logs" / "bad").exists() and not (tmp_path / "ckpt" / "bad").exists()
