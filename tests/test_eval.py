"""Evaluation: loss and bits per byte per validation set, per tag, micro and macro; plugins'
evaluators during training; ``levanter eval`` on a checkpoint."""

import json
import math
import os
import subprocess
import sys

import pytest
import yaml
from pydantic import Field

import levanter_core.plugins as plugins
from conftest import code_docs, metrics, run_config, write_jsonl
from levanter_core.cli import main
from levanter_core.config.train import load_train_config
from levanter_core.data.dataset.sequences import held_out_count
from levanter_core.plugins import hookimpl
from levanter_core.run import run_training
from levanter_core.testing import simulated_devices, tiny_hf_llama
from levanter_core.trainer.evaluators import Evaluator, EvaluatorConfig, eval_metrics

LN2 = math.log(2)


def test_eval_metrics_by_hand():
    totals = {"a": [10.0, 5.0, 20.0], "b": [6.0, 3.0, 3.0], "c": [4.0, 2.0, 0.0]}
    m = eval_metrics(totals, {"both": ["a", "b"], "none": ["zzz"]}, per_set=True)
    assert m["eval/loss"] == pytest.approx(20 / 10)  # every token: (10 + 6 + 4) / (5 + 3 + 2)
    assert m["eval/bpb"] == pytest.approx(20 / (LN2 * 23))
    assert m["eval/macro_loss"] == pytest.approx((2 + 2 + 2) / 3)
    assert "eval/macro_bpb" not in m  # c stands for no bytes: it has no bits per byte
    assert m["eval/a/bpb"] == pytest.approx(10 / (LN2 * 20)) and "eval/c/bpb" not in m
    assert m["eval/both/loss"] == m["eval/both/micro_loss"] == pytest.approx(16 / 8)
    assert m["eval/both/bpb"] == pytest.approx(16 / (LN2 * 23))
    assert m["eval/both/macro_bpb"] == pytest.approx((10 / (LN2 * 20) + 6 / (LN2 * 3)) / 2)
    assert not any(k.startswith("eval/none") for k in m)
    assert "eval/a/loss" not in eval_metrics(totals, {}, per_set=False)


def prose_docs(n):
    return [{"text": f"The {i}th walk by the river was long, and the evening light was gold. " * 2} for i in range(n)]


def tagged_data(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir(exist_ok=True)
    write_jsonl(data_dir / "code.jsonl", code_docs(60))
    write_jsonl(data_dir / "code-val.jsonl", code_docs(12, offset=900))
    write_jsonl(data_dir / "prose.jsonl", prose_docs(60))
    write_jsonl(data_dir / "prose-val.jsonl", prose_docs(12))
    sources = {
        name: {
            "train_urls": [str(data_dir / f"{name}.jsonl")],
            "validation_urls": [str(data_dir / f"{name}-val.jsonl")],
            "tags": tags,
        }
        for name, tags in (("code", ["python", "all_text"]), ("prose", ["english", "all_text"]))
    }
    return {"cache_dir": str(tmp_path / "cache"), "configs": sources, "train_weights": {"code": 1, "prose": 1}}


STEPS_SEEN = []


class ProbeEvaluator(Evaluator):
    def __init__(self, config, context):
        self.config, self.context = config, context

    def evaluate(self, model, step):
        STEPS_SEEN.append(step)
        import jax

        norm = sum(float((x**2).sum()) for x in jax.tree.leaves(model) if hasattr(x, "shape"))
        return {f"{self.config.prefix}/param_norm": norm, f"{self.config.prefix}/seq_len": self.context.seq_len}


class ProbeConfig(EvaluatorConfig):
    prefix: str = "probe"
    """Where its metrics go."""

    def build(self, context):
        return ProbeEvaluator(self, context)


class HarnessStandIn(EvaluatorConfig):
    """Registered as eval_harness: takes Levanter's section's fields."""

    task_spec: list = Field(default_factory=list)
    max_examples: int | None = None

    def build(self, context):
        return ProbeEvaluator(ProbeConfig(prefix="lm_eval"), context)


class Unbuildable(EvaluatorConfig):
    """An evaluator whose task does not exist."""

    def build(self, context):
        from levanter_core.errors import UserError

        raise UserError("evaluators[0]: no task named nonsense")


class Probes:
    @hookimpl
    def register_evaluators(self, register):
        register("probe", ProbeConfig)
        register("unbuildable", Unbuildable)
        register("eval_harness", HarnessStandIn)


@pytest.fixture
def probes():
    # no entry-point plugins (levanter-eval-harness, if installed, registers eval_harness too): GPT-2
    # and these stand-ins only
    import levanter_model_gpt2.plugin

    plugins.reset(autoload=False)
    plugins.register_plugin(levanter_model_gpt2.plugin)
    plugins.register_plugin(Probes(), name="probes")
    STEPS_SEEN.clear()
    yield STEPS_SEEN
    plugins.reset()


def test_training_logs_bpb_per_set_and_tag_and_runs_plugin_evaluators(tmp_path, probes):
    path = run_config(tmp_path, tagged_data(tmp_path), steps=6)
    overrides = ["--evaluators", '[{"type": "probe", "every": 2}]', "--eval_harness", '{"task_spec": ["x"]}',
                 "--eval_harness_steps", "4"]  # fmt: skip
    config, _ = load_train_config(path, overrides)
    assert [type(e).__name__ for e, _ in config.run_evaluators()] == ["ProbeConfig", "HarnessStandIn"]
    run_training(config, progress=False)
    # probe every 2 steps, the harness every 4 and after the last step
    assert probes == [2, 4, 4, 6, 6]

    records = metrics(tmp_path)
    evals = [m for m in records if "eval/loss" in m]
    assert [m["step"] for m in evals] == [0, 3, 6]
    for m in evals:
        for prefix in ("eval", "eval/all_text"):
            assert {f"{prefix}/loss", f"{prefix}/bpb", f"{prefix}/macro_loss", f"{prefix}/macro_bpb"} <= set(m)
        for name in ("code", "prose", "python", "english"):
            assert {f"eval/{name}/loss", f"eval/{name}/bpb"} <= set(m)
        assert m["eval/python/loss"] == m["eval/code/loss"] and m["eval/english/bpb"] == m["eval/prose/bpb"]
        assert m["eval/macro_loss"] == pytest.approx((m["eval/code/loss"] + m["eval/prose/loss"]) / 2)
        # byte tokenizer: a token is a byte, but the end-of-text token stands for none
        for name in ("code", "prose"):
            assert m[f"eval/{name}/bpb"] > m[f"eval/{name}/loss"] / LN2
    probe = {m["step"]: m for m in records if "probe/param_norm" in m}
    assert sorted(probe) == [2, 4, 6] and probe[2]["probe/seq_len"] == 32
    assert probe[2]["probe/param_norm"] != probe[6]["probe/param_norm"]
    assert sorted(m["step"] for m in records if "lm_eval/param_norm" in m) == [4, 6]


def test_an_evaluator_that_cannot_be_built_stops_the_run_before_its_first_step(tmp_path, probes):
    from levanter_core.errors import UserError

    data = {"train_urls": [write_jsonl(tmp_path / "a.jsonl", code_docs(10))], "cache_dir": str(tmp_path / "cache")}
    config, _ = load_train_config(
        run_config(tmp_path, data, steps=4), ["--evaluators", '[{"type": "unbuildable", "every": 2}]']
    )
    with pytest.raises(UserError, match="no task named nonsense"):
        run_training(config, progress=False)
    log = tmp_path / "logs" / "pipe" / "metrics.jsonl"
    assert not log.exists() or not [m for m in metrics(tmp_path) if m.get("step", 0) >= 1]
    assert not list((tmp_path / "ckpt").glob("*/step-*"))


def test_eval_harness_without_its_plugin_says_what_to_install(tmp_path, fresh_plugins):
    path = run_config(tmp_path, {"train_urls": [write_jsonl(tmp_path / "a.jsonl", code_docs(10))]})
    from levanter_core.errors import ConfigError

    with pytest.raises(ConfigError, match="levanter-eval-harness plugin, which is not installed"):
        load_train_config(path, ["--eval_harness", '{"task_spec": ["hellaswag"]}'])


def expected_totals(docs: list[str], seq_len: int) -> tuple[int, int]:
    """Predicted tokens and their bytes, by hand, for the byte tokenizer: the documents' UTF-8
    bytes each followed by the end-of-text id (256), cut into whole sequences of seq_len; every
    position but the last of a sequence predicts the next; the end-of-text id is no byte."""
    stream = [b for d in docs for b in [*d.encode("utf-8"), 256]]
    rows = len(stream) // seq_len
    targets = [t for r in range(rows) for t in stream[r * seq_len + 1 : (r + 1) * seq_len]]
    return len(targets), sum(t != 256 for t in targets)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny GPT-2 trained 4 steps on code; its checkpoint and validation files."""
    tmp_path = tmp_path_factory.mktemp("eval-run")
    train = write_jsonl(tmp_path / "train.jsonl", code_docs(40))
    val = write_jsonl(tmp_path / "val.jsonl", code_docs(9, offset=500))
    prose = write_jsonl(tmp_path / "prose.jsonl", prose_docs(5) + [{"text": "Ça coûte 5 € — naïve café"}])
    path = run_config(tmp_path, {"train_urls": [train], "validation_urls": [val], "cache_dir": str(tmp_path / "cache")},
                      steps=4, steps_per_eval=4, max_eval_batches=None)  # fmt: skip
    config, _ = load_train_config(path)
    result = run_training(config, progress=False)
    return {"checkpoint": result.checkpoint, "config": path, "val": val, "prose": prose, "tmp": tmp_path}


def run_eval(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", *args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_levanter_eval_counts_bytes_as_by_hand(trained, capsys):
    code, out, err = run_eval(capsys, trained["checkpoint"], "--data", trained["val"], "--data", trained["prose"],
                              "--json", "--batch-size", "3")  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    for name, file in (("val", trained["val"]), ("prose", trained["prose"])):
        docs = [json.loads(line)["text"] for line in open(file)]
        tokens, nbytes = expected_totals(docs, seq_len=32)
        entry = report["eval_sets"][name]
        assert (entry["tokens"], entry["bytes"]) == (tokens, nbytes)
        assert entry["bpb"] == pytest.approx(entry["loss"] * tokens / nbytes / LN2)
    sets = report["eval_sets"]
    assert report["loss"] == pytest.approx(
        sum(s["loss"] * s["tokens"] for s in sets.values()) / sum(s["tokens"] for s in sets.values())
    )
    assert report["macro_bpb"] == pytest.approx((sets["val"]["bpb"] + sets["prose"]["bpb"]) / 2)

    code, table, _ = run_eval(capsys, trained["checkpoint"], "--data", trained["val"])
    assert code == 0 and "bpb" in table.splitlines()[0] and f"{sets['val']['loss']:.4f}" in table


def test_levanter_eval_on_a_configs_validation_set_matches_training(trained, capsys):
    code, out, err = run_eval(capsys, trained["checkpoint"], "--config", trained["config"], "--json")
    assert code == 0, err
    report = json.loads(out)
    # the run's last evaluation saw the same sequences with the same weights
    final = [m for m in metrics(trained["tmp"]) if "eval/loss" in m][-1]
    assert final["step"] == 4
    assert report["loss"] == pytest.approx(final["eval/loss"], rel=1e-5)
    assert report["bpb"] == pytest.approx(final["eval/bpb"], rel=1e-5)
    # and the file itself, given with --data, reads the same
    code, out, _ = run_eval(capsys, trained["checkpoint"], "--data", trained["val"], "--json")
    assert json.loads(out)["eval_sets"]["val"]["loss"] == pytest.approx(report["loss"], rel=1e-6)


def test_levanter_eval_on_the_held_out_fraction_of_a_configs_training_data(trained, capsys):
    """``data.validation_split_fraction``: the config's validation set is the last quarter of
    its training sequences (as training would hold it out), not its validation file."""
    args = ["--config", trained["config"], "--data.validation_split_fraction", "0.25", "--json"]
    code, out, err = run_eval(capsys, trained["checkpoint"], *args)
    assert code == 0, err
    docs = [json.loads(line)["text"] for line in open(trained["tmp"] / "train.jsonl")]
    sequences = expected_totals(docs, seq_len=32)[0] // 31  # each predicts 31 tokens
    assert json.loads(out)["eval_sets"]["main"]["tokens"] == held_out_count(sequences, 0.25) * 31


def test_levanter_eval_mistakes(trained, capsys, tmp_path):
    code, _, err = run_eval(capsys, trained["checkpoint"])
    assert code == 2 and "give --config CONFIG" in err
    code, _, err = run_eval(capsys, trained["checkpoint"], "--data", str(tmp_path / "missing.jsonl"))
    assert code == 2 and "missing.jsonl: no such file" in err
    short = write_jsonl(tmp_path / "short.jsonl", [{"text": "tiny"}])
    code, _, err = run_eval(capsys, trained["checkpoint"], "--data", short)
    assert code == 2 and f"--data {short}: the complete cache holds 5 tokens, not one sequence of seq_len 32" in err


def test_levanter_eval_data_errors_suggest_what_eval_can_do(trained, capsys, tmp_path):
    """`levanter eval --data` has no format, skip_bad_data or seq_len settings: its errors do not
    tell a user to set them (only to put them in a training config given with --config)."""
    from levanter_core.data.cache import SKIP_BAD_DATA_HINT
    from levanter_core.data.dataset import TOO_SHORT_HINT
    from levanter_core.data.formats import TEXT_KEY_HINT

    files = {
        "other field": write_jsonl(tmp_path / "content.jsonl", [{"content": "x" * 200}]),
        "bad line": str(tmp_path / "bad.jsonl"),
        "too short": write_jsonl(tmp_path / "tiny.jsonl", [{"text": "tiny"}]),
    }
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "x" * 200}) + "\n{not json\n")
    errors = {}
    for case, file in files.items():
        code, _, err = errors[case] = run_eval(capsys, trained["checkpoint"], "--data", file)
        assert code == 2 and file in err, (case, err)
        # what a training run is told ("set data.skip_bad_data: true", "shorten the sequences"...)
        assert not any(hint in err for hint in (TEXT_KEY_HINT, SKIP_BAD_DATA_HINT, TOO_SHORT_HINT)), (case, err)
    err = errors["other field"][2]
    assert "reads each record's 'text' field" in err and "--config" in err
    assert "add data" in errors["too short"][2]


@pytest.mark.slow
def test_levanter_eval_of_a_hugging_face_model_reads_the_same_on_two_devices(tmp_path, capsys):
    docs = prose_docs(30)
    model = tiny_hf_llama(str(tmp_path / "model"), [d["text"] for d in docs], vocab_size=300)
    data = write_jsonl(tmp_path / "prose.jsonl", docs)
    code, out, err = run_eval(capsys, model, "--data", data, "--json")
    assert code == 0, err
    one = json.loads(out)
    # JAX fixes its device count when it starts: the two devices live in a subprocess
    env = {**os.environ, **simulated_devices(2)}
    command = [
        sys.executable,
        "-c",
        "from levanter_core.cli import main; main()",
        "eval",
        model,
        "--data",
        data,
        "--json",
    ]
    two = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    assert json.loads(two.stdout)["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert one["eval_sets"]["prose"]["tokens"] > 256  # more than one sequence of the model's context


def test_a_levanter_eval_lm_config_names_the_model_and_the_length(trained, capsys, tmp_path):
    """Levanter's eval_lm config (checkpoint_path, max_eval_length, the data and model of a
    training config) evaluates with ``levanter eval --config`` alone: its validation set, its
    sequences max_eval_length tokens long."""
    raw = yaml.safe_load(open(trained["config"]))
    raw.update(checkpoint_path=trained["checkpoint"], max_eval_length=16, eval_on_train=False)
    path = tmp_path / "eval_lm.yaml"
    path.write_text(yaml.safe_dump(raw))
    code, out, err = run_eval(capsys, "--config", str(path), "--json")
    assert code == 0, err
    docs = [json.loads(line)["text"] for line in open(trained["val"])]
    assert json.loads(out)["eval_sets"]["main"]["tokens"] == expected_totals(docs, seq_len=16)[0]

    raw.update(hf_checkpoint="org/model")
    path.write_text(yaml.safe_dump(raw))
    code, _, err = run_eval(capsys, "--config", str(path))
    assert code == 2 and "hf_checkpoint" in err and "not both" in err
    raw.pop("hf_checkpoint")
    raw.update(max_eval_length=64)  # the model's context is 32
    path.write_text(yaml.safe_dump(raw))
    code, _, err = run_eval(capsys, "--config", str(path))
    assert code == 2 and "max_eval_length (64) exceeds the model's context (32" in err
