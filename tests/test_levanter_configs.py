"""Levanter's own ``train_lm`` configs load through our loader and mean what they mean in Levanter.

The reference set is ``../shared/levanter-configs/`` (every YAML of Levanter's repository at its
last release); it is read from there, never copied, and the tests skip where it is absent.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from levanter_core.config.train import load_train_config
from levanter_core.errors import ConfigError
from levanter_core.plugins import registry


def load_yaml_fragment(path) -> dict:
    import yaml

    with open(path) as f:
        return yaml.safe_load(f)


REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "levanter-configs"

# What needs a later issue's plugin: each config, and what its error must name.
LATER = {
    "config/backpack_nano.yaml": "unknown model type 'backpack'",  # Levanter itself no longer has it
    "config/gpt2_nano_harness.yaml": "levanter-eval-harness",
    "config/gpt2_small_fast_eval.yaml": "levanter-eval-harness",
}


def _entry_point(relative: str, text: str) -> str:
    """Which Levanter program a config belongs to, by the rules of the reference set's README."""
    name = os.path.basename(relative)
    if relative.startswith(("config/data/", "config/optim/")):
        return "fragment"
    if relative.startswith("config/harness/"):
        return "eval_harness"
    if relative.startswith("config/sampler/"):
        return "sample_lm"
    if relative.startswith("config/export/") or name.startswith("convert_"):
        return "export_lm_to_hf"
    if "lora" in relative:
        return "lora_lm"
    if relative.startswith("examples/alpaca/"):
        return "alpaca"
    if "whisper" in name:
        return "train_asr"
    if "supervised_data" in text or "dataset_type" in text or name.startswith("sft_"):
        return "sft"
    if "mixture_weights" in text:
        return "sft_mixture"
    return "train_lm"


def _train_lm_configs() -> list[str]:
    if not REFERENCE.is_dir():
        return []
    found = []
    for path in sorted(REFERENCE.rglob("*.yaml")):
        relative = path.relative_to(REFERENCE).as_posix()
        if _entry_point(relative, path.read_text()) == "train_lm":
            found.append(relative)
    return found


CONFIGS = _train_lm_configs()
needs_reference = pytest.mark.skipif(not CONFIGS, reason=f"Levanter's configs are not at {REFERENCE}")


def _harness_installed() -> bool:
    from levanter_core.plugins import registry

    return "eval_harness" in registry("evaluator")


def _load(relative: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # trainer.wandb, optimizer.cooldown
        return load_train_config(str(REFERENCE / relative))[0]


@needs_reference
def test_the_reference_set_has_58_train_lm_configs():
    assert len(CONFIGS) == 58


@needs_reference
@pytest.mark.parametrize("relative", CONFIGS or ["none"])
def test_each_train_lm_config_loads(relative):
    if LATER.get(relative) == "levanter-eval-harness" and _harness_installed():
        config = _load(relative)  # the plugin is installed: its section loads
        assert config.eval_harness is not None and config.run_evaluators()[-1][1] == config.eval_harness_steps
        return
    if relative in LATER:
        with pytest.raises(ConfigError) as raised:
            _load(relative)
        assert LATER[relative] in str(raised.value)
        assert relative.split("/")[-1] in str(raised.value)  # the message names the file
        return
    config = _load(relative)
    assert config.model.type and config.trainer.num_train_steps > 0


@needs_reference
def test_sophia_and_muon_configs_mean_what_they_mean_in_levanter():
    """The six configs that only failed for want of an optimizer (levanter-optim-contrib)."""
    small = _load("config/gpt2_small_sophiah.yaml").optimizer  # optimizer: !include optim/sophia-h_small.yaml
    assert (small.type, small.learning_rate, small.weight_decay, small.gamma, small.warmup) == (
        "sophia-h",
        6e-4,
        0.2,
        0.01,
        2000,
    )
    assert (small.beta1, small.beta2, small.update_interval, small.clip_threshold) == (0.96, 0.99, 10, 1.0)
    fast = _load("config/gpt2_small_fast_sophiah.yaml").optimizer
    assert (fast.learning_rate, fast.gamma, fast.warmup) == (0.8e-3, 0.005, 0.01)
    muon = _load("config/gpt2_small_fast_muon.yaml").optimizer
    assert (muon.type, muon.learning_rate, muon.weight_decay, muon.adam_lr, muon.momentum) == (
        "muon",
        1e-2,
        0.05,
        6e-4,
        0.95,
    )
    for fragment in ("small", "medium", "large", "xl"):
        section = load_yaml_fragment(REFERENCE / "config" / "optim" / f"sophia-h_{fragment}.yaml")
        assert registry("optimizer").get(section.pop("type")).config_cls.model_validate(section).gamma > 0


@needs_reference
def test_levanter_defaults_are_kept_where_a_config_leaves_fields_out():
    config = _load("config/gpt2_small.yaml")  # names neither shuffle, tokenizer nor optimizer type
    assert config.data.shuffle is False  # Levanter reads in order unless asked
    assert config.data.tokenizer == "gpt2"
    assert config.optimizer.type == "adam"


@needs_reference
def test_tracker_sections_without_type_are_wandb_and_trainer_wandb_is_the_tracker():
    untyped = _load("config/gpt2_small_fast_itest.yaml")  # tracker: {project: levanter, tags: [...]}
    assert [t.type for t in untyped.trainer.tracker] == ["wandb"]
    assert untyped.trainer.tracker[0].project == "levanter"
    assert "itest" in untyped.trainer.tracker[0].tags
    deprecated = _load("config/train_lm_llama3_tulu_sft.yaml")  # trainer.wandb (deprecated) wins
    assert [t.type for t in deprecated.trainer.tracker] == ["wandb"]
    assert deprecated.trainer.tracker[0].name == "llama3_tulu_sft_seed0_shuffle_fixed_tokenizer"


@needs_reference
def test_sources_with_id_inside_configs_are_hugging_face_datasets():
    config = _load("config/gpt2_small_fast_mix.yaml")
    types = {name: source.type for name, source in config.data.configs.items()}
    assert "hf" in types.values() and "url" in types.values()


@needs_reference
def test_fields_that_change_the_run_are_read():
    schedule = _load("config/gpt2_small_fast_batch_schedule.yaml").trainer.batch_schedule
    assert schedule.size_at(0) == 64 and schedule.size_at(100) == 128 and schedule.size_at(2000) == 256
    assert schedule.offset_at(65) == 64 * 64 + 128
    fp8 = _load("config/gpt2_nano_fp8.yaml").trainer.quantization
    assert fp8 is not None and fp8.fp8
    nested = _load("config/llama_small_fast_remat.yaml").model
    assert nested.gradient_checkpointing == "nested"
    tulu = _load("config/llama_7b_tulu.yaml")
    assert tulu.model.use_layer_norm_weight is False
    llama2 = _load("config/llama2_7b.yaml")
    assert llama2.model.attn_backend == "auto" and llama2.model.reference_checkpoint == "NousResearch/Llama-2-7b-hf"
    assert llama2.data.tokenizer == "NousResearch/Llama-2-7b-hf"
    continued = _load("config/llama2_7b_continued.yaml")
    assert continued.hf_source == continued.model.hf_checkpoint
