"""Re-running a finished run with a larger ``trainer.num_train_steps`` names a new run (the id
hashes the config) that starts at step 0: the run says so, naming the finished run and how to
continue it, and ``--trainer.id`` of the finished run does continue it (docs/checkpoints.md)."""

import logging

from levanter_core.config.train import load_train_config
from levanter_core.run import run_training
from levanter_core.testing import code_docs, run_config, write_jsonl


def test_a_finished_run_made_longer_is_a_new_run_and_says_how_to_continue(tmp_path, caplog):
    data = {
        "train_urls": [write_jsonl(tmp_path / "train.jsonl", code_docs(40))],
        "cache_dir": str(tmp_path / "cache"),
    }
    path = run_config(tmp_path, data, run_id="longer", steps=2, id=None, steps_per_eval=100)
    config, _ = load_train_config(path)
    first = run_training(config, config_path=path, progress=False)
    assert first.final_step == 2

    longer, _ = load_train_config(path, ["--trainer.num_train_steps", "4"])
    with caplog.at_level(logging.WARNING, logger="levanter_core"):
        second = run_training(longer, config_path=path, progress=False)
    assert second.run_id != first.run_id and second.start_step == 0  # what the warning is about
    [warning] = [
        r.getMessage()
        for r in caplog.records
        if first.run_id in r.getMessage() and "starts at step 0" in r.getMessage()
    ]
    assert "starts at step 0" in warning and "finished with a checkpoint at step 2" in warning
    assert f"--trainer.id {first.run_id}" in warning and "docs/checkpoints.md" in warning

    # what the warning advises: the finished run resumes at its last step and trains on
    caplog.clear()
    continued, _ = load_train_config(path, ["--trainer.num_train_steps", "4", "--trainer.id", first.run_id])
    with caplog.at_level(logging.WARNING, logger="levanter_core"):
        third = run_training(continued, config_path=path, progress=False)
    assert (third.run_id, third.start_step, third.final_step) == (first.run_id, 2, 4)
    assert not [r for r in caplog.records if "starts at step 0" in r.getMessage()]
