"""Training objectives as plugins: a plugin's objective, named by its model type, trains through
the same trainer (placement of its own batch arrays, the step, evaluation) as language
modelling, and a model type whose objective is not installed is refused by name."""

import numpy as np
import pytest

import levanter_core.plugins as plugins
from conftest import code_docs, metrics, run_config, write_jsonl
from levanter_core.config.train import load_train_config
from levanter_core.errors import ConfigError
from levanter_core.objective import BatchField, LmObjective
from levanter_core.plugins import hookimpl
from levanter_core.run import run_training

WEIGHT = 3.0


class WeightedLm(LmObjective):
    """Next-token prediction with a weight per row, carried by the batch as an array of its
    own (one number per row: no position axis)."""

    name = "weighted_lm"

    def fields(self, batch):
        tokens = getattr(batch, "tokens", batch)
        return {**super().fields(batch), "row_weight": BatchField(np.full(len(tokens), WEIGHT), (), np.float32)}

    def example(self, arrays):
        return super().example(arrays), arrays["row_weight"]

    def loss(self, model, example, *, key):
        lm_example, weight = example
        loss, logged = super().loss(model, lm_example, key=key)
        return loss * weight.array.mean(), logged

    def eval_loss(self, model, example):
        return super().eval_loss(model, example[0])

    def eval_totals(self, model, example, *constants):
        return super().eval_totals(model, example[0], *constants)


def _weighted_gpt2():
    from levanter_model_gpt2.gpt2 import Gpt2Config

    class WeightedGpt2Config(Gpt2Config):
        objective = "weighted_lm"

    return WeightedGpt2Config


class WeightedModel:
    @hookimpl
    def register_models(self, register):
        register("weighted_gpt2", _weighted_gpt2())


class Weighted(WeightedModel):
    @hookimpl
    def register_objectives(self, register):
        register("weighted_lm", WeightedLm)


def _gpt2_and(plugin, name: str):
    """Only the GPT-2 model plugin and ``plugin`` registered, for the fixture's test."""
    import levanter_model_gpt2.plugin

    plugins.reset(autoload=False)
    plugins.register_plugin(levanter_model_gpt2.plugin)
    plugins.register_plugin(plugin, name=name)


@pytest.fixture
def weighted():
    _gpt2_and(Weighted(), "weighted")
    yield
    plugins.reset()


def _run(tmp_path, model_type: str):
    tmp_path.mkdir()
    data = {"train_urls": [write_jsonl(tmp_path / "train.jsonl", code_docs(30))],
            "validation_urls": [write_jsonl(tmp_path / "val.jsonl", code_docs(6, offset=300))],
            "cache_dir": str(tmp_path / "cache")}  # fmt: skip
    path = run_config(tmp_path, data, steps=2, steps_per_eval=2, run_id=model_type)
    config, _ = load_train_config(path, ["--model.type", model_type])
    run_training(config, progress=False)
    return list(metrics(tmp_path, run_id=model_type))


def test_a_plugins_objective_trains_through_the_same_trainer(tmp_path, weighted):
    plain = _run(tmp_path / "plain", "gpt2")
    heavy = _run(tmp_path / "heavy", "weighted_gpt2")
    plain_train = [m["train/loss"] for m in plain if "train/loss" in m]
    heavy_train = [m["train/loss"] for m in heavy if "train/loss" in m]
    # the first step sees the same weights and batch: only the objective's row weights differ
    assert heavy_train[0] == pytest.approx(WEIGHT * plain_train[0], rel=1e-5)
    # evaluation is the objective's too (here the plain cross-entropy), before any step
    initial = [m for m in heavy if m.get("step") == 0 and "eval/loss" in m]
    assert initial and initial[0]["eval/loss"] == pytest.approx(
        next(m for m in plain if m.get("step") == 0)["eval/loss"]
    )
    assert "eval/bpb" in initial[0]


def test_a_model_type_whose_objective_is_not_installed_is_refused_by_name(tmp_path, weighted):
    plugins.reset(autoload=False)
    plugins.register_plugin(WeightedModel(), name="model-without-its-objective")
    data = {"train_urls": [write_jsonl(tmp_path / "train.jsonl", code_docs(10))], "cache_dir": str(tmp_path / "cache")}
    config, _ = load_train_config(run_config(tmp_path, data, steps=1), ["--model.type", "weighted_gpt2"])
    with pytest.raises(
        ConfigError, match="model.type 'weighted_gpt2' trains with the 'weighted_lm' objective: unknown objective type"
    ):
        run_training(config, progress=False)


class AnchorOptions(__import__("levanter_core.config.base", fromlist=["ConfigModel"]).ConfigModel):
    pull: float = 1.0


class AnchoredLm(LmObjective):
    """Next-token prediction plus ``pull`` times the squared distance of the weights from the
    reference (the weights as training started): an objective that keeps a reference."""

    name = "anchored_lm"
    keeps_reference = True
    options = AnchorOptions

    def __init__(self, pull: float = 1.0):
        super().__init__()
        self.pull = pull

    @classmethod
    def from_config(cls, config):
        return cls(**dict(config.objective_options))

    def loss(self, model, example, *, key, reference):
        import equinox as eqx
        import jax
        import jax.numpy as jnp

        loss, logged = super().loss(model, example, key=key)
        ours, theirs = (jax.tree.leaves(eqx.filter(m, eqx.is_inexact_array)) for m in (model, reference))
        distance = sum(jnp.sum((a.astype(jnp.float32) - b.astype(jnp.float32)) ** 2) for a, b in zip(ours, theirs))
        return loss + self.pull * distance, {**logged, "anchor/distance": distance}

    def eval_loss(self, model, example, *, reference):
        return super().eval_loss(model, example)

    def eval_totals(self, model, example, *constants, reference):
        return super().eval_totals(model, example, *constants)


class Anchored:
    @hookimpl
    def register_objectives(self, register):
        register("anchored_lm", AnchoredLm)


@pytest.fixture
def anchored():
    _gpt2_and(Anchored(), "anchored")
    yield
    plugins.reset()


def test_a_run_picks_an_objective_that_keeps_the_starting_model_as_reference(tmp_path, anchored):
    from levanter_core.checkpoint import read_metadata

    plain = _run(tmp_path / "plain", "gpt2")
    (tmp_path / "anchored").mkdir()
    data = {"train_urls": [write_jsonl(tmp_path / "anchored" / "train.jsonl", code_docs(30))],
            "validation_urls": [write_jsonl(tmp_path / "anchored" / "val.jsonl", code_docs(6, offset=300))],
            "cache_dir": str(tmp_path / "anchored" / "cache")}  # fmt: skip
    path = run_config(tmp_path / "anchored", data, steps=3, steps_per_eval=3, run_id="anchored")
    config, _ = load_train_config(path, ["--objective", '{"type": "anchored_lm", "pull": 0.5}'])
    assert config.objective_options.pull == 0.5
    run_training(config, progress=False)
    logged = [m for m in metrics(tmp_path / "anchored", run_id="anchored") if "train/loss" in m]
    # the reference is the model as it started: no distance at the first step, so the loss is the LM's
    assert logged[0]["anchor/distance"] == 0.0
    assert logged[0]["train/loss"] == pytest.approx(next(m for m in plain if "train/loss" in m)["train/loss"], rel=1e-6)
    assert logged[-1]["anchor/distance"] > 0  # the model moved away from it, the reference did not
    leaves = [
        leaf["name"] for leaf in read_metadata(str(tmp_path / "anchored" / "ckpt" / "anchored" / "step-3"))["leaves"]
    ]
    assert any(name.startswith("reference/") for name in leaves)  # kept with the state, for an exact resume


def test_an_unknown_objective_or_setting_names_the_field(tmp_path, anchored):
    data = {"train_urls": [write_jsonl(tmp_path / "train.jsonl", code_docs(4))], "cache_dir": str(tmp_path / "cache")}
    path = run_config(tmp_path, data, steps=1)
    with pytest.raises(
        ConfigError, match=r"objective \(command line.*unknown objective 'dop'; installed: .*anchored_lm"
    ):
        load_train_config(path, ["--objective", "dop"])
    with pytest.raises(ConfigError, match="objective .*the 'anchored_lm' objective's settings: strength: Extra inputs"):
        load_train_config(path, ["--objective", '{"type": "anchored_lm", "strength": 2}'])
