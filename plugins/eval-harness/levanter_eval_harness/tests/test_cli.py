"""``levanter eval-harness`` as a user runs it: the files it writes (laid out as ``lm_eval``'s own
command writes them), Levanter's harness configs, and the mistakes it refuses with exit status 2
and a message naming what is wrong. lm-eval's task index is built once per include path for
these tests (``task_index.py``: 15 CPU-seconds each time)."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from levanter_core.cli import main
from levanter_core.testing import listed_plugin
from levanter_eval_harness.tests.task_index import shared_index  # noqa: F401 (a fixture)

HARNESS_CONFIGS = Path(__file__).resolve().parents[5] / "shared" / "levanter-configs" / "config" / "harness"

pytestmark = pytest.mark.usefixtures("shared_index")


def harness(capsys, *args) -> tuple[int, str, str]:
    """Run ``levanter eval-harness ARGS`` in this process: exit status, stdout, stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(["eval-harness", *args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def _undated(path: str) -> str:
    """A file name of lm-eval's with its date left out."""
    return re.sub(r"_\d{4}-\d\d-\d\dT[\d\-.]+\.(jsonl?)$", r"_DATE.\1", os.path.basename(path))


def _files(out_dir) -> dict[str, list[str]]:
    """Folder -> file names (undated) under an output directory."""
    found: dict[str, list[str]] = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "*", "*"))):
        found.setdefault(os.path.basename(os.path.dirname(path)), []).append(_undated(path))
    return found


@pytest.mark.slow
def test_results_and_samples_are_laid_out_as_lm_eval_writes_them(model_dir, tasks_dir, tmp_path, capsys):
    ours_dir, theirs_dir = tmp_path / "ours", tmp_path / "theirs"
    common = ["--tasks", "tiny_mc,tiny_ppl", "--include-path", tasks_dir, "--limit", "3", "--log-samples"]
    code, out, err = harness(capsys, model_dir, *common, "--output-path", str(ours_dir), "--max-length", "64",
                             "--bootstrap-iters", "0")  # fmt: skip
    assert code == 0, err
    assert "tiny_mc acc:" in out and "tiny_ppl word_perplexity:" in out
    assert f"results written under {ours_dir}" in out

    # lm_eval's own command line, on the same model, in a process of its own (it forks, which
    # a process running JAX must not)
    command = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={model_dir},max_length=64",
               "--tasks", "tiny_mc,tiny_ppl", "--include_path", tasks_dir, "--limit", "3",
               "--log_samples", "--output_path", str(theirs_dir), "--device", "cpu"]  # fmt: skip
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    theirs_run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert theirs_run.returncode == 0, theirs_run.stderr[-3000:]

    assert _files(ours_dir) == _files(theirs_dir)
    (folder,) = _files(ours_dir)
    assert folder == model_dir.replace("/", "__")
    ours = json.loads(next(ours_dir.glob("*/results_*.json")).read_text())
    theirs = json.loads(next(theirs_dir.glob("*/results_*.json")).read_text())
    assert set(ours) == set(theirs)
    assert (
        ours["n-samples"]
        == theirs["n-samples"]
        == {t: {"original": n, "effective": 3} for t, n in (("tiny_mc", 9), ("tiny_ppl", 4))}
    )
    assert ours["results"]["tiny_mc"]["acc,none"] == theirs["results"]["tiny_mc"]["acc,none"]
    for task in ("tiny_mc", "tiny_ppl"):
        our_lines = next(ours_dir.glob(f"*/samples_{task}_*.jsonl")).read_text().splitlines()
        their_lines = next(theirs_dir.glob(f"*/samples_{task}_*.jsonl")).read_text().splitlines()
        assert len(our_lines) == len(their_lines) == 3
        assert [sorted(json.loads(line)) for line in our_lines] == [sorted(json.loads(line)) for line in their_lines]


@pytest.mark.slow
def test_a_task_spec_alias_runs_one_task_twice_with_its_own_fewshot(model_dir, tasks_dir, tmp_path, capsys):
    config = tmp_path / "harness.yaml"
    config.write_text(
        "eval_harness:\n"
        "  task_spec:\n"
        "    - tiny_mc\n"
        "    - {task: tiny_mc, num_fewshot: 2, task_alias: tiny_mc_2shot}\n"
        "  max_examples: 2\n"
        "  max_eval_length: 128\n"
        f"checkpoint_path: {model_dir}\n"
    )
    code, _out, err = harness(capsys, "--config", str(config), "--include-path", tasks_dir,
                             "--output-path", str(tmp_path / "out"), "--log-samples")  # fmt: skip
    assert code == 0, err
    results = json.loads(next((tmp_path / "out").glob("*/results_*.json")).read_text())
    assert results["n-shot"] == {"tiny_mc": 0, "tiny_mc_2shot": 2}
    (two_shot,) = [
        json.loads(line) for line in next((tmp_path / "out").glob("*/samples_tiny_mc_2shot_*.jsonl")).open()
    ][:1]
    context = two_shot["arguments"]["gen_args_0"]["arg_0"]
    assert context.count("\n\n") == 2  # two solved examples before the question


def test_an_alias_renames_a_group_and_its_tasks_and_settings_reach_them(manager):
    from levanter_eval_harness.tasks import load_tasks

    (group,) = load_tasks([{"task": "tiny_group", "task_alias": "tiny_group_1shot", "num_fewshot": 1}], manager)
    assert group.name == "tiny_group_1shot"
    tasks = {t.task_name: t for t in group.get_all_tasks()}
    assert sorted(tasks) == ["tiny_mc_1shot", "tiny_ppl_1shot"] == sorted(group.child_names)
    assert tasks["tiny_mc_1shot"].get_config("num_fewshot") == 1


def test_installed_as_a_command_and_an_evaluator():
    ours = listed_plugin("levanter-eval-harness")
    assert ours["error"] is None
    assert set(ours["hooks"]) == {"register_commands", "register_evaluators"}


@pytest.mark.parametrize(
    "args, message",
    [
        (("--tasks", "tiny_mc", "--output-path", "out", "--bogus", "3"), "unknown option '--bogus'"),
        (("--output-path", "out"), "name the tasks to run: --tasks"),
        (("--tasks", "tiny_mc"), "name where to write the results: --output-path OUT"),
        (("--tasks", "tiny_mc", "--output-path", "out", "--limit", "2.5"), "--limit 2.5"),
    ],
)
def test_mistakes_exit_2_naming_them(model_dir, capsys, args, message):
    code, _, err = harness(capsys, model_dir, *args)
    assert code == 2 and message in err and "Traceback" not in err


def test_no_source_exits_2(capsys):
    code, _, err = harness(capsys, "--tasks", "hellaswag", "--output-path", "out")
    assert code == 2 and "name the model to evaluate: SOURCE" in err


def test_an_unknown_task_exits_2_with_close_names(model_dir, tasks_dir, capsys, tmp_path):
    code, _, err = harness(capsys, model_dir, "--tasks", "tiny_mc,tiny_mcq", "--include-path", tasks_dir,
                           "--output-path", str(tmp_path))  # fmt: skip
    assert code == 2 and "Traceback" not in err
    assert "unknown task 'tiny_mcq' (did you mean 'tiny_mc'" in err
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_a_registry_task_reads_its_data_from_the_datasets_cache_offline(model_dir, tmp_path, capsys, monkeypatch):
    import datasets

    from levanter_eval_harness.tests.tiny import cache_hub_dataset

    # lm-eval's own lambada_openai, by name: its data (EleutherAI/lambada_openai) as a first
    # online run would have left it in the datasets cache
    texts = ["the quick brown fox jumps over the lazy dog", "hello world, how are you today?", "a harness asks a model"]
    cache = str(tmp_path / "datasets-cache")
    cache_hub_dataset(cache, "EleutherAI/lambada_openai", "default", "test", [{"text": t} for t in texts])
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    code, out, err = harness(capsys, model_dir, "--tasks", "lambada_openai", "--output-path", str(tmp_path / "out"),
                             "--max-length", "64", "--bootstrap-iters", "0")  # fmt: skip
    assert code == 0, err
    assert "lambada_openai perplexity:" in out and "lambada_openai acc:" in out
    results = json.loads(next((tmp_path / "out").glob("*/results_*.json")).read_text())
    assert results["n-samples"]["lambada_openai"] == {"original": 3, "effective": 3}
    assert 0 < results["results"]["lambada_openai"]["perplexity,none"] < float("inf")


@pytest.mark.parametrize("missing", [False, True])
def test_a_source_that_is_no_model_exits_2(tasks_dir, capsys, tmp_path, missing):
    source = str(tmp_path / "nowhere") if missing else str(tmp_path)
    code, _, err = harness(capsys, source, "--tasks", "tiny_mc", "--include-path", tasks_dir,
                           "--output-path", str(tmp_path / "out"))  # fmt: skip
    assert code == 2 and "Traceback" not in err
    assert ("is not a local directory" if missing else "neither one of our checkpoints") in err


def test_a_missing_include_path_exits_2(model_dir, capsys, tmp_path):
    code, _, err = harness(capsys, model_dir, "--tasks", "tiny_mc", "--include-path", str(tmp_path / "nowhere"),
                           "--output-path", str(tmp_path / "out"))  # fmt: skip
    assert code == 2 and f"--include-path {tmp_path / 'nowhere'}: no such directory" in err


@pytest.mark.skipif(not HARNESS_CONFIGS.is_dir(), reason="Levanter's configs are not beside the repository")
@pytest.mark.parametrize("name", ["harness_nano.yaml", "eval_llama3.yaml"])
def test_levanters_harness_configs_load(name):
    from levanter_eval_harness.config import load_main_config

    config = load_main_config(str(HARNESS_CONFIGS / name))
    harness_section = config.eval_harness
    if name == "harness_nano.yaml":
        assert harness_section.task_spec == [{"task": "mmlu", "num_fewshot": 1, "task_alias": "mmlu_1shot"}]
        assert config.tokenizer == "gpt2" and config.checkpoint_path is None
        assert config.trainer.mp == "f32"
    else:
        assert harness_section.task_spec == [{"task": "commonsense_qa", "num_fewshot": 10}]
        assert harness_section.max_eval_length == 4096
        assert config.checkpoint_is_hf and config.checkpoint_path == "meta-llama/Meta-Llama-3-8B"
    assert harness_section.bootstrap_iters == 0 and harness_section.max_examples is None


@pytest.mark.skipif(not HARNESS_CONFIGS.is_dir(), reason="Levanter's configs are not beside the repository")
def test_a_levanter_config_runs_until_its_tasks_need_the_network(model_dir, capsys, tmp_path):
    """harness_nano names no model (Levanter takes --checkpoint_path on the command line) and its
    task (mmlu) reads its data from the hub, which these tests cannot reach."""
    config = str(HARNESS_CONFIGS / "harness_nano.yaml")
    code, _, err = harness(capsys, "--config", config, "--output-path", str(tmp_path))
    assert code == 2 and "name the model to evaluate" in err
    code, _, err = harness(capsys, "--config", config, "--checkpoint_path", model_dir, "--output-path", str(tmp_path))
    assert code == 2 and "Traceback" not in err
    assert "task 'mmlu' could not be loaded" in err and "HF_DATASETS_CACHE" in err


def test_a_bad_config_field_exits_2_naming_it(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("eval_harness:\n  task_spec: [hellaswag]\n  max_examples: -1\ncheckpoint_path: x\n")
    code, _, err = harness(capsys, "--config", str(config), "--output-path", str(tmp_path))
    assert code == 2 and "eval_harness.max_examples" in err and "Traceback" not in err
