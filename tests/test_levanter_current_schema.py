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
        (
            {"model": {"max_seq_len": 32}, "train_seq_len": 64},
            r"train_seq_len \(64\) cannot exceed the model's context",
        ),
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


# -- data.components -------------------------------------------------------------------------


def _sources(tmp_path) -> dict:
    """Two url sources' locations (web: 60 documents, code: 40), each with validation data."""
    found = {}
    for name, n in (("web", 60), ("code", 40)):
        found[name] = {
            "train_urls": [write_jsonl(tmp_path / f"{name}.jsonl", code_docs(n, offset=1000 * len(found)))],
            "validation_urls": [write_jsonl(tmp_path / f"{name}-val.jsonl", code_docs(8, offset=500 + len(found)))],
        }
    return found


def _with_data(tmp_path, data: dict, run_id: str) -> str:
    path = run_config(tmp_path, data, run_id=run_id, steps=2)
    raw = yaml.safe_load(open(path))
    raw["data"].pop("tokenizer")
    raw["data"] = {"tokenizer": "byte", **data}
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    return path


def _components(tmp_path, **extra) -> dict:
    where = _sources(tmp_path)
    return {
        "cache_dir": str(tmp_path / "cache-components"),
        "components": {
            "web": {"source": {"type": "url", **where["web"]}, "tags": ["english"]},
            "code": {"source": {"type": "url", **where["code"]}, "format": {"type": "text", "text_key": "text"}},
        },
        "train_weights": {"web": 0.75, "code": 0.25},
        **extra,
    }


def test_components_are_the_mixture_the_older_configs_form_writes(tmp_path):
    """Levanter's components and our configs: one mixture, the same sources, caches, tags and
    weights; trained, the same batches give the same losses."""
    where = _sources(tmp_path)
    current = _components(tmp_path, shuffle=False)
    older = {
        "cache_dir": str(tmp_path / "cache-configs"),
        "configs": {
            "web": {"type": "url", **where["web"], "tags": ["english"]},
            "code": {"type": "url", **where["code"], "format": {"type": "text", "text_key": "text"}},
        },
        "train_weights": {"web": 0.75, "code": 0.25},
        "shuffle": False,
    }
    a, _ = load_train_config(_with_data(tmp_path, current, "components"))
    b, _ = load_train_config(_with_data(tmp_path, older, "configs"))
    # (no source holds out validation sequences here, so where they would come from is moot)
    same = {"exclude": {"cache_dir", "shuffle_before_trainval_split"}}
    assert a.data.model_dump(**same) == b.data.model_dump(**same)
    assert a.data.is_mixture and a.data.configs["web"].tags == ["english"]
    # a component's cache: {data.cache_dir}/{name}/{split}, as in Levanter
    assert a.data.cache_path("code", "train") == f"{tmp_path}/cache-components/code/train"
    first = run_training(a, config_path="components.yaml", progress=False)
    second = run_training(b, config_path="configs.yaml", progress=False)
    assert (first.first_loss, first.last_loss, first.final_eval_loss) == (
        second.first_loss,
        second.last_loss,
        second.final_eval_loss,
    )


def test_a_component_keeps_its_own_cache_dir_and_reads_a_hugging_face_source(tmp_path):
    data = _components(tmp_path)
    data["components"]["web"]["cache_dir"] = str(tmp_path / "elsewhere")
    data["components"]["hub"] = {"source": {"type": "hf", "id": "org/data", "name": "en"}}
    try:
        config, _ = load_train_config(_with_data(tmp_path, data, "hub"))
    except ConfigError as e:  # levanter-data-hf not installed: the hf type is named as missing
        assert "hf" in str(e)
        return
    assert config.data.cache_path("web", "validation") == f"{tmp_path}/elsewhere/validation"
    assert config.data.configs["hub"].type == "hf"


@pytest.mark.parametrize(
    ("shuffle", "era"),
    [(None, 256 * 512), ({"io_block_size": 4, "window_blocks": 8}, 32), (True, True), (False, False)],
)
def test_the_block_shuffle_is_an_era_shuffle_over_as_many_sequences(tmp_path, shuffle, era):
    extra = {} if shuffle is None else {"shuffle": shuffle}
    config, _ = load_train_config(_with_data(tmp_path, _components(tmp_path, **extra), "shuffle"))
    assert config.data.shuffle == era


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["components"]["web"]["source"].update(train_urls=7), r"data\.components\.web\.source\.train_urls"),
        (lambda d: d["components"]["web"].update(pack=True), r"data\.components\.web\.pack .*packing whole text"),
        (lambda d: d["components"]["web"].update(colour="red"), r"data\.components\.web\.colour .*not a field"),
        (lambda d: d["components"]["web"].pop("source"), r"data\.components\.web\.source .*Levanter's caches"),
        (lambda d: d.update(configs={}), r"data\.configs .*one form"),
        (lambda d: d["train_weights"].update(nowhere=1.0), r"nowhere"),
    ],
)
def test_a_component_error_names_the_component_and_the_field_as_written(tmp_path, change, message):
    data = _components(tmp_path)
    change(data)
    with pytest.raises(ConfigError, match=message):
        load_train_config(_with_data(tmp_path, data, "bad"))


def test_held_out_sequences_are_a_random_subset_unless_the_config_says_otherwise(tmp_path):
    data = _components(tmp_path, num_validation_sequences={"web": 2})
    config, _ = load_train_config(_with_data(tmp_path, data, "held"))
    assert config.data.num_validation_sequences == {"web": 2} and config.data.shuffle_before_trainval_split
    data = _components(tmp_path, num_validation_sequences={"web": 2}, shuffle_before_trainval_split=False)
    config, _ = load_train_config(_with_data(tmp_path, data, "held"))
    assert not config.data.shuffle_before_trainval_split


# -- Levanter's train_dpo, lora_dpo and train_simpo configs ------------------------------------

GENERATION_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}\n"
    "{% endif %}{% endfor %}"
)
"""A chat template with Hugging Face's generation blocks, as Levanter's DPO configs write them."""


def _dpo(tmp_path, **top) -> dict:
    """A train_dpo config in Levanter's current schema (its dpo_tiny_gpt2.yaml's shape), as a dict."""
    pairs = [
        {
            "chosen": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"good {i}"}],
            "rejected": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"bad {i}"}],
        }
        for i in range(20)
    ]
    config = {
        "data": {
            "tokenizer": "byte",
            "cache_dir": str(tmp_path / "cache"),
            "components": {
                "default": {
                    "source": {"type": "url", "train_urls": [write_jsonl(tmp_path / "pairs.jsonl", pairs)]},
                    "format": {"type": "preference_chat", "chat_template": GENERATION_TEMPLATE, "pack": False},
                }
            },
        },
        "model": {**CONTEXT, "max_seq_len": 64},
        "train_seq_len": 64,
        "trainer": {"train_batch_size": 4, "num_train_steps": 2, "require_accelerator": False},
        "adapter": {"type": "none"},
        "reference": {"type": "separate", "model_path": "hf/tiny-gpt2", "is_hf": True},
        "beta": 0.2,
        "initialize_from_hf": "hf/tiny-gpt2",
    }
    config.update(top)
    return config


def _load(tmp_path, raw: dict):
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_train_config(str(path))[0]


def test_a_train_dpo_config_is_a_dpo_run_with_levanters_defaults(tmp_path):
    config = _load(tmp_path, _dpo(tmp_path))
    assert config.objective == {"type": "dpo", "beta": 0.2, "label_smoothing": 0.0}
    # the default validation_split_fraction of Levanter's train_dpo: its last tenth validates
    assert config.data.validation_split_fraction == 0.1 and config.data.held_out() == {"default": 0.1}
    fmt = config.data.configs["default"].format
    assert (fmt.type, fmt.chosen_key, fmt.rejected_key, fmt.chat_template) == (
        "preference",
        "chosen",
        "rejected",
        GENERATION_TEMPLATE,
    )
    assert config.lora is None and config.initialize_from_hf == "hf/tiny-gpt2"


def test_a_lora_dpo_config_trains_adapters_against_their_base(tmp_path):
    raw = _dpo(
        tmp_path,
        adapter={"type": "lora", "r": 4, "alpha": 8.0, "zero_init_b": True, "a_init_mode": "random"},
        reference={"type": "adapter_base"},
        validation_split_fraction=None,
    )
    config = _load(tmp_path, raw)
    assert (config.lora.r, config.lora.alpha) == (4, 8.0)
    assert config.data.validation_split_fraction is None and config.objective["type"] == "dpo"


def test_the_older_reference_fields_name_the_reference_too(tmp_path):
    raw = _dpo(tmp_path, reference_model_path="hf/tiny-gpt2", reference_is_hf=True)
    raw.pop("reference")
    assert _load(tmp_path, raw).objective["beta"] == 0.2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"reference": {"type": "separate", "model_path": "hf/other"}},
            r"reference\.model_path .*a different reference \('hf/other'\) is not available",
        ),
        ({"reference": {"type": "separate"}}, r"reference\.model_path must be provided"),
        ({"reference": {"type": "adapter_base"}}, r"adapter_base requires a non-none adapter"),
        (
            {"adapter": {"type": "lora", "zero_init_b": True}, "reference": {"type": "adapter_base"}},
            r"exactly one zero LoRA factor",
        ),
        ({"lm_validation_data": {"tokenizer": "byte"}}, r"lm_validation_data is not available"),
        ({"validation_split_fraction": 1.0}, r"validation_split_fraction \(validation_split_fraction at"),
    ],
)
def test_what_levanters_dpo_refuses_or_this_one_cannot_do_is_refused_by_name(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, _dpo(tmp_path, **change))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("slice_strategy", "drop", "slice_strategy must be 'raise'"),
        ("pack", True, "Packed preference_chat datasets are not supported"),
        ("system_prompt", "system", "system prompt taken from a record's field"),
    ],
)
def test_preference_chat_settings_without_meaning_here_are_refused(tmp_path, field, value, message):
    raw = _dpo(tmp_path)
    raw["data"]["components"]["default"]["format"][field] = value
    with pytest.raises(ConfigError, match=rf"data\.components\.default\.format\.{field} .*{message}"):
        _load(tmp_path, raw)


def test_a_chat_component_is_the_chat_format_packed_whole(tmp_path):
    """Supervised fine-tuning in Levanter's current schema: train_lm with a chat component."""
    data = _components(tmp_path)
    data["components"]["web"]["format"] = {
        "type": "chat", "messages_field": "conversation", "pack": True, "mask_user_turns": True,
        "chat_template_kwargs": "chat_template_kwargs",
    }  # fmt: skip
    config, _ = load_train_config(_with_data(tmp_path, data, "chat"))
    fmt = config.data.configs["web"].format
    assert (fmt.type, fmt.messages_field, fmt.mask_user_turns, fmt.packed) == ("chat", "conversation", True, True)
    data["components"]["web"]["format"]["pack"] = False
    with pytest.raises(ConfigError, match=r"data\.components\.web\.format\.pack .*packed whole"):
        load_train_config(_with_data(tmp_path, data, "chat"))


# -- sample_lm ---------------------------------------------------------------------------------


def test_a_current_sample_lm_config_loads(tmp_path):
    from levanter_core.inference.sample import load_sample_config

    raw = {
        "hf_checkpoint": "org/model",
        "model": {"type": "llama", "max_seq_len": 4096},
        "trainer": {"mesh": {"axes": {"model": 1}}, "mp": "p=f32,c=bfloat16"},
        "engine": {"max_seqs": 4, "page_size": 8, "max_pages_per_seq": 4},
        "prompts": ["Four score and seven years ago, our"],
        "max_new_tokens": 16,
        "log_kernel_jaxprs_path": None,
    }
    path = tmp_path / "sample.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = load_sample_config(str(path))
    assert (config.source, config.engine.max_seq_len(4096), config.max_new_tokens) == ("org/model", 32, 16)
    path.write_text(yaml.safe_dump({**raw, "log_kernel_jaxprs_path": "jaxprs/"}))
    with pytest.raises(ConfigError, match="log_kernel_jaxprs_path"):
        load_sample_config(str(path))
