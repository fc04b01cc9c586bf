"""The ``eval_harness`` evaluator in a training run: Levanter's section validates (and refuses
what it cannot honour by name), and a run's trackers get the numbers ``levanter eval-harness``
gives for the same weights. The run's evaluator and the command share one lm-eval task index
(``task_index.py``: building it takes 15 CPU-seconds; a run's evaluator keeps one for all its
evaluations too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from levanter_core.cli import main
from levanter_eval_harness.tests.task_index import shared_index  # noqa: F401 (a fixture)

LEVANTER_CONFIGS = Path(__file__).resolve().parents[5] / "shared" / "levanter-configs" / "config"


def _harness(section: dict):
    from levanter_eval_harness.config import HarnessConfig

    return HarnessConfig.model_validate(section)


@pytest.mark.skipif(not LEVANTER_CONFIGS.is_dir(), reason="Levanter's configs are not beside the repository")
@pytest.mark.parametrize("name", ["gpt2_nano_harness.yaml", "gpt2_small_fast_eval.yaml"])
def test_levanters_training_configs_with_eval_harness_load(name):
    from levanter_core.config.train import load_train_config
    from levanter_eval_harness.config import HarnessConfig

    config, _ = load_train_config(str(LEVANTER_CONFIGS / name), [])
    harness = config.eval_harness
    assert isinstance(harness, HarnessConfig)
    if name == "gpt2_nano_harness.yaml":
        assert harness.task_spec == ["mmlu"] and harness.max_examples == 32 and config.eval_harness_steps == 50
    else:
        assert harness.task_spec == ["piqa", "hellaswag"] and harness.max_examples == 2048
        assert config.eval_harness_steps == 1000
    assert harness.bootstrap_iters == 0 and harness.confirm_run_unsafe_code


def test_levanters_fields_are_accepted_and_what_cannot_be_honoured_is_refused_by_name():
    harness = _harness({
        "task_spec": ["hellaswag", {"task": "hellaswag", "num_fewshot": 10, "task_alias": "hellaswag_10shot"}],
        "max_length": 512, "log_samples": True, "apply_chat_template": True, "fewshot_as_multiturn": True,
        "sample_logging": {"max_samples_per_benchmark": 5},
        "generation_kwargs": {"max_gen_toks": 64, "temperature": 0.7, "seed": 3},
    })  # fmt: skip
    assert harness.max_eval_length == 512 and harness.sample_logging.should_log()
    assert harness.generation_defaults() == {"temperature": 0.7, "seed": 3, "do_sample": True}
    with pytest.raises(Exception, match="n \\(several generations per request\\) is not supported"):
        _harness({"task_spec": ["gsm8k"], "generation_kwargs": {"n": 4}})
    with pytest.raises(Exception, match="unknown generation setting beams"):
        _harness({"task_spec": ["gsm8k"], "generation_kwargs": {"beams": 4}})
    with pytest.raises(Exception, match="task"):
        _harness({"task_spec": [{"num_fewshot": 3}]})
    with pytest.raises(Exception, match="max_examples"):
        _harness({"task_spec": ["hellaswag"], "max_examples": 0})


def _train_config(tmp_path, model_dir, tasks_dir) -> str:
    """Two steps at learning rate 0 from the tiny Hugging Face model: the weights evaluated
    are that model's."""
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"the quick brown fox jumps over the lazy dog {i}"}) + "\n" for i in range(64))
    )
    config = tmp_path / "run.yaml"
    config.write_text(f"""
data:
  train_urls: [{data}]
  tokenizer: {model_dir}
  cache_dir: {tmp_path / "cache"}
model:
  type: llama
  seq_len: 64
initialize_from_hf: {model_dir}
use_hf_model_config: true
trainer:
  mp: p=f32
  train_batch_size: 4
  num_train_steps: 2
  steps_per_eval: 1000
  log_dir: {tmp_path / "logs"}
  id: harness-run
  tracker: {{type: json}}
  checkpointer: {{base_path: {tmp_path / "ckpt"}}}
optimizer:
  learning_rate: 0.0
  weight_decay: 0.0
eval_harness:
  task_spec: [tiny_mc, tiny_ppl, tiny_gen]
  max_examples: 4
  include_path: {tasks_dir}
  sample_logging: {{max_samples_per_benchmark: 2}}
  generation_kwargs: {{max_gen_toks: 8}}
eval_harness_steps: 2
""")
    return str(config)


@pytest.mark.slow
@pytest.mark.usefixtures("shared_index")
def test_a_training_run_logs_what_the_command_gives_for_the_same_weights(model_dir, tasks_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", _train_config(tmp_path, model_dir, tasks_dir), "--no-progress"])
    assert done.value.code == 0
    run_dir = tmp_path / "logs" / "harness-run"
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (at_2,) = [m for m in logged if m["step"] == 2]
    assert not any(k.startswith("lm_eval/") for m in logged if m["step"] == 1 for k in m)
    (results_file,) = (run_dir / "lm_eval" / "step-2").glob("results_*.json")
    (samples,) = (run_dir / "lm_eval" / "step-2").glob("samples_tiny_mc_*.jsonl")
    assert len(samples.read_text().splitlines()) == 2  # sample_logging.max_samples_per_benchmark

    with pytest.raises(SystemExit) as done:
        main(["eval-harness", model_dir, "--tasks", "tiny_mc,tiny_ppl,tiny_gen", "--include-path", tasks_dir,
              "--limit", "4", "--max-length", "64", "--max-gen-toks", "8", "--bootstrap-iters", "0",
              "--output-path", str(tmp_path / "cli")])  # fmt: skip
    assert done.value.code == 0
    cli = json.loads(next((tmp_path / "cli").glob("*/results_*.json")).read_text())["results"]
    for task, metric in [("tiny_mc", "acc"), ("tiny_mc", "acc_norm"), ("tiny_ppl", "byte_perplexity"),
                         ("tiny_ppl", "word_perplexity"), ("tiny_gen", "exact_match")]:  # fmt: skip
        assert at_2[f"lm_eval/{task}/{metric}"] == pytest.approx(cli[task][f"{metric},none"], rel=1e-6)
    assert at_2["lm_eval/averages/macro_avg_acc"] == pytest.approx(cli["tiny_mc"]["acc,none"])
    assert json.loads(results_file.read_text())["results"]["tiny_mc"]["acc,none"] == at_2["lm_eval/tiny_mc/acc"]
