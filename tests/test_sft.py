"""Supervised fine-tuning: special tokens added to a tokenizer (and the model grown to fit),
Levanter's ``sft`` / ``sft_mixture`` configs read by ``levanter train``, and a fine-tuned model
exported, loaded by ``transformers`` and chatting through ``levanter sample --chat``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import run_cli
from levanter_core.config.train import load_train_config
from levanter_core.data.formats import render_chat_prompt
from levanter_core.data.tokenizer import load_tokenizer, tokenizer_spec_with
from levanter_core.errors import ConfigError, DataError
from levanter_core.testing import tiny_hf_llama, write_jsonl

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "levanter-configs"
needs_reference = pytest.mark.skipif(not REFERENCE.is_dir(), reason=f"Levanter's configs are not at {REFERENCE}")

# A chat template that ends each assistant turn with the end-of-text token, as chat models' do.
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}"
    "{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)
TEXTS = ["the quick brown fox jumps over the lazy dog", "hello there, how are you today? fine thanks"] * 20


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> str:
    """A tiny random Llama whose tokenizer names a beginning and an end of text but no pad and no
    unknown token (as Llama 3's): Levanter's sft adds two tokens to it."""
    directory = str(tmp_path_factory.mktemp("base"))
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "chat_template": TEMPLATE}
    return tiny_hf_llama(directory, TEXTS, vocab_size=300, context=64, tokenizer_config=config)


# -- the tokenizer ---------------------------------------------------------------------------------


def test_levanters_defaults_add_the_missing_pad_and_unknown_tokens(base_model):
    base = load_tokenizer(base_model)
    grown = load_tokenizer(tokenizer_spec_with(base_model, {"add_missing_defaults": True}))
    assert grown.added_tokens == ("[PAD]", "<unk>")
    assert grown.vocab_size == base.vocab_size + 2
    assert [grown.token_id("[PAD]"), grown.token_id("<unk>")] == [base.vocab_size, base.vocab_size + 1]
    assert grown.named_special_tokens() == {
        "pad_token": "[PAD]", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "unk_token": "<unk>"
    }  # fmt: skip
    # the old ids are unchanged, the new tokens are matched whole, and the cache sees another tokenizer
    text = "the lazy dog[PAD]"
    assert grown.encode_batch([text])[0].tolist() == [*base.encode_batch(["the lazy dog"])[0].tolist(), base.vocab_size]
    assert grown.fingerprint != base.fingerprint


def test_added_tokens_are_kept_once_and_a_role_cannot_change(base_model):
    spec = tokenizer_spec_with(base_model, {"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    assert tokenizer_spec_with(spec, {"additional_special_tokens": ["<|im_end|>"]}) == spec  # idempotent
    assert load_tokenizer(spec).added_tokens == ("<|im_start|>", "<|im_end|>")
    with_eos = tokenizer_spec_with(spec, {"eos_token": "<|im_end|>"})
    assert load_tokenizer(with_eos).eos_token == "<|im_end|>"  # an existing token given a role: no new id
    assert load_tokenizer(with_eos).vocab_size == load_tokenizer(spec).vocab_size
    with pytest.raises(DataError, match="already sets eos_token"):
        tokenizer_spec_with(with_eos, {"eos_token": "</s>"})


def test_the_grown_tokenizer_loads_in_transformers_with_its_roles(base_model, tmp_path):
    transformers = pytest.importorskip("transformers")
    spec = tokenizer_spec_with(
        base_model, {"add_missing_defaults": True, "additional_special_tokens": ["<|im_start|>"]}
    )
    grown = load_tokenizer(spec)
    for name, text in grown.hf_files().items():
        (tmp_path / name).write_text(text)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(theirs) == grown.vocab_size
    assert (theirs.pad_token, theirs.unk_token, theirs.eos_token) == ("[PAD]", "<unk>", "<|endoftext|>")
    assert theirs.pad_token_id == grown.token_id("[PAD]")
    text = "hello<|im_start|>the lazy dog<unk>"
    assert theirs(text, add_special_tokens=False)["input_ids"] == grown.encode_batch([text])[0].tolist()
    rendered = theirs.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "[user] hi\n[assistant]" == render_chat_prompt([{"role": "user", "content": "hi"}], grown)


# -- our own config: the special_tokens section ------------------------------------------------------


def write_config(tmp_path: Path, config: dict, name: str = "run.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


def test_special_tokens_join_the_runs_tokenizer_and_chat_data_uses_them(base_model, tmp_path):
    from levanter_core.data.formats import ChatFormat

    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    template += "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    config = {
        "data": {
            "tokenizer": base_model,
            "train_urls": ["chats.jsonl"],
            "format": {"type": "chat", "chat_template": template},
        },
        "model": {"type": "llama", "seq_len": 64},
        "special_tokens": {"additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "eos_token": "<|im_end|>"},
    }
    loaded, _ = load_train_config(write_config(tmp_path, config))
    tokenizer = load_tokenizer(loaded.data.tokenizer)
    start, end = tokenizer.token_id("<|im_start|>"), tokenizer.token_id("<|im_end|>")
    # roles first (the end of turn), then the additional tokens
    assert (end, start) == (tokenizer.vocab_size - 2, tokenizer.vocab_size - 1) and tokenizer.eos_id == end
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    encoded = ChatFormat(chat_template=template).encode_batch([chat], ["chats.jsonl:1"], tokenizer, None)[0]
    ids = encoded.ids.tolist()
    assert ids.count(start) == 2 and ids.count(end) == 2
    # the targets are the assistant's words and the end of its turn, nothing of the user's turn
    targets = [i for i, m in zip(ids, encoded.target_mask) if m]
    assert tokenizer.decode(targets) == "hello<|im_end|>\n"


def test_reinit_tokens_needs_initialize_from_hf(base_model, tmp_path):
    config = {
        "data": {"tokenizer": base_model, "train_urls": ["x.jsonl"]},
        "model": {"type": "llama", "seq_len": 64},
        "special_tokens": {"reinit_tokens": ["hello"]},
    }
    with pytest.raises(ConfigError, match="reinit_tokens .*initialize_from_hf"):
        load_train_config(write_config(tmp_path, config))


def test_reinitialize_rows_redraws_only_the_named_rows():
    import haliax as hax
    import jax
    import jax.numpy as jnp

    from levanter_core.models.token_rows import reinitialize_rows

    Vocab, Embed = hax.Axis("vocab", 50), hax.Axis("embed", 8)
    weight = hax.named(jax.random.normal(jax.random.PRNGKey(0), (50, 8)) * 0.02 + 1.0, (Vocab, Embed))
    model = {"embed": weight, "lm_head": weight.rearrange((Embed, Vocab))}
    out = reinitialize_rows(model, [3, 7], jax.random.PRNGKey(1), lm_head=False)
    changed = jnp.any(out["embed"].array != weight.array, axis=1)
    assert np.flatnonzero(np.asarray(changed)).tolist() == [3, 7]
    assert jnp.array_equal(out["lm_head"].array, model["lm_head"].array)  # reinit_lm_head: false
    # drawn with the matrix's own mean and spread: near 1.0, not near 0
    assert jnp.allclose(out["embed"].array[jnp.array([3, 7])].mean(), 1.0, atol=0.05)


# -- Levanter's sft and sft_mixture configs ------------------------------------------------------------

# Each of Levanter's SFT configs, and what loading it gives: "loads", or the words of its error
# (Levanter itself refuses these: no model to start from, or no data).
SFT_CONFIGS = {
    "config/sft_llama3.1_tulu3.yaml": "loads",
    "config/sft_llama3_openthoughts.yaml": "fine-tuning starts from a trained model",
    "config/sft_llama3.1_tulu3_mixture.yaml": "loads",
    "config/sft_llama3_mixture.yaml": "loads",
    "config/sft_llama3_mixture_generic.yaml": "loads",
    "config/sft_llama3_mixture_reason.yaml": "loads",
    "config/sft_tootsie_mixture.yaml": "loads",
    "config/olmo2_sft.yaml": "loads",
    "config/sft_hf_llama3_ckpt.yaml": "supervised_data",  # a fragment: model and tokenizer only
    "examples/sft/alpaca-llama-sft.yaml": "fine-tuning starts from a trained model",
    "examples/sft/tulu-llama-sft.yaml": "fine-tuning starts from a trained model",
    "examples/sft/alpaca-llama.yaml": "loads",
    "examples/sft/dolly-llama.yaml": "loads",
    "examples/sft/oasst-llama.yaml": "loads",
}


def _hf_source_installed() -> bool:
    from levanter_core.plugins import registry

    return "hf" in registry("data_source")


@needs_reference
@pytest.mark.parametrize("relative", sorted(SFT_CONFIGS))
def test_each_levanter_sft_config_loads_or_says_what_levanter_would(relative):
    expected = SFT_CONFIGS[relative]
    if relative.startswith("examples/sft/") and expected == "loads" and not _hf_source_installed():
        pytest.skip("Hugging Face datasets come with levanter-data-hf")
    if expected != "loads":
        with pytest.raises(ConfigError) as raised:
            load_train_config(str(REFERENCE / relative))
        assert expected in str(raised.value) and os.path.basename(relative) in str(raised.value)
        return
    config, _ = load_train_config(str(REFERENCE / relative))
    assert config.special_tokens.add_missing_defaults and config.data.tokenizer.endswith(
        '+{"add_missing_defaults": true}'
    )
    assert config.use_hf_model_config and config.data.effective_shuffle is True


@needs_reference
def test_levanter_sft_configs_mean_what_they_mean_in_levanter():
    single, _ = load_train_config(str(REFERENCE / "config/sft_llama3.1_tulu3.yaml"))
    source = single.data.configs["main"]
    assert single.initialize_from_hf == "meta-llama/Llama-3.1-8B" and single.model.seq_len == 4096
    assert source.train_urls[0].startswith("gs://marin-us-central2/documents/allenai--tulu-v2")
    assert source.format.type == "chat" and single.data.cache_dir.endswith(
        "tulu_3_sft_mixture_llama3_instruct_tokenizer-8f8ba3"
    )
    assert single.hf_save_steps == 500 and single.hf_save_path.endswith("hf/seed_0/")

    mixture, _ = load_train_config(str(REFERENCE / "config/sft_tootsie_mixture.yaml"))
    assert set(mixture.data.configs) == {"tulu", "openthoughts", "prime_verified_math", "acecode", "smoltalk",
                                         "natural_reasoning", "stratos", "dolphinr1"}  # fmt: skip
    weights = dict(mixture.data.weight_stages()[0][1])
    assert weights["tulu"] == 1.0 and weights["smoltalk"] == 0.0
    assert mixture.data.mixture_block_size == 2048 and mixture.data.stop_strategy == "restart"
    assert mixture.initialize_from_hf.startswith("gs://marin-us-central2/checkpoints/tootsie-8b")
    assert mixture.special_tokens.tokens_to_reinit()[-1] == "<|eot_id|>"  # reinit_tokens: true

    olmo, _ = load_train_config(str(REFERENCE / "config/olmo2_sft.yaml"))
    assert (
        olmo.model.type == "olmo2" and olmo.model.upcast_attn
    )  # a run setting kept; the architecture is the checkpoint's


def sft_config(tmp_path: Path, base: str, **changes) -> dict:
    """A Levanter ``sft`` config, written as Levanter's are, on a tiny model."""
    chats = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}] * 8
    config = {
        "dataset_type": "chat_jsonl",
        "chat_train_urls": [write_jsonl(tmp_path / "chats.jsonl", chats)],
        "supervised_data": {"cache_dir": str(tmp_path / "cache")},
        "max_seq_len": 64,
        "tokenizer": base,
        "model": {"type": "llama"},
        "trainer": {
            "id": "sft", "train_batch_size": 4, "num_train_steps": 40, "steps_per_eval": 1000,
            "log_dir": str(tmp_path / "logs"), "checkpointer": {"base_path": str(tmp_path / "ckpt"), "keep": []},
            "tracker": {"type": "json"},
        },
        "optimizer": {"learning_rate": 3e-3, "weight_decay": 0.0, "warmup": 0, "min_lr_ratio": 1.0},
        "initialize_from_hf": True,
        "model_name_or_path": base,
        "hf_save_path": str(tmp_path / "hf"),
        "messages_field": "messages",
        "input_role": "user",
        "output_role": "assistant",
        "epoch": 0,
    }  # fmt: skip
    config.update(changes)
    return config


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"dataset_type": "chat"}, "dataset_type", "expected chat_jsonl or huggingface"),
        ({"output_role": "gpt"}, "output_role", "only 'assistant'"),
        ({"supervised_data": {"cache_dir": "c", "train_url": ["x"]}}, "supervised_data.train_url", "unknown field"),
        ({"mixture_weights": {"tulu": 1}}, "mixture_weights", "named sources"),
        ({"stop_strategy": "never"}, "stop_strategy", "restart"),
        ({"max_seq_len": "long"}, "max_seq_len", "integer"),
    ],
)
def test_a_bad_sft_field_is_named_as_written_with_its_line(base_model, tmp_path, changes, field, message):
    if "stop_strategy" in changes:  # a mixture's setting: give it named sources
        changes = {**changes, "supervised_data": {"a": {"cache_dir": "c", "train_urls": ["x.jsonl"]}},
                   "mixture_weights": {"a": 1}, "chat_train_urls": None}  # fmt: skip
    config = {k: v for k, v in sft_config(tmp_path, base_model, **changes).items() if v is not None}
    path = write_config(tmp_path, config, "sft.yaml")
    lines = Path(path).read_text().splitlines()
    line = 1 + next(i for i, text in enumerate(lines) if text.strip().startswith(field.split(".")[-1] + ":"))
    with pytest.raises(ConfigError) as raised:
        load_train_config(path)
    text = str(raised.value)
    assert field in text and f"sft.yaml:{line}" in text and message in text, text


def test_a_bad_sft_config_exits_2_without_a_traceback(base_model, tmp_path):
    path = write_config(tmp_path, sft_config(tmp_path, base_model, dataset_type="chat"), "sft.yaml")
    result = run_cli("train", path, "--dry-run")
    assert result.returncode == 2, result.stderr
    assert "dataset_type" in result.stderr and "Traceback" not in result.stderr


# -- end to end ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sft_from_an_import_with_two_added_tokens_exports_and_chats(base_model, tmp_path, capsys):
    """Levanter's sft on a tiny imported Llama whose tokenizer lacks a pad and an unknown token:
    both are added, the model grows by two rows (at the mean of the others), it learns the
    conversation, and the export loads in ``transformers`` and chats through ``levanter sample``."""
    import torch
    import transformers

    from levanter_core.cli import main
    from levanter_core.run import run_training

    path = write_config(tmp_path, sft_config(tmp_path, base_model), "sft.yaml")
    config, _ = load_train_config(path)
    result = run_training(config, config_path=path, progress=False)
    printed = capsys.readouterr().out
    assert "added special tokens [PAD], <unk>" in printed
    assert result.final_step == 40

    base = transformers.AutoModelForCausalLM.from_pretrained(base_model)
    exported = str(tmp_path / "hf" / "sft" / "step-40")
    model = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    old = base.config.vocab_size
    assert model.config.vocab_size == len(tokenizer) == old + 2
    assert (tokenizer.pad_token, tokenizer.unk_token) == ("[PAD]", "<unk>") and tokenizer.pad_token_id == old
    assert model.config.pad_token_id == old
    # the new tokens never appear in the data, so their input rows are still the mean of the others
    rows = model.get_input_embeddings().weight.detach()
    mean = base.get_input_embeddings().weight.detach().mean(dim=0)
    torch.testing.assert_close(rows[old:], mean.expand(2, -1), atol=1e-6, rtol=0)

    # transformers chats with the tokenizer's template and gives the answer the model learned ...
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    generated = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True).strip() == "hello there"

    # levanter export-hf of the run's checkpoint writes the same grown tokenizer
    again = str(tmp_path / "again")
    with pytest.raises(SystemExit) as exit_info:
        main(["export-hf", str(tmp_path / "ckpt" / "sft"), again])
    assert exit_info.value.code == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert Path(again, name).read_text() == Path(exported, name).read_text()

    # levanter sample --chat gives the same answer, stopping at the end of the turn
    with pytest.raises(SystemExit) as exit_info:
        main(["sample", exported, "--chat", "--prompt", "hi", "--temperature", "0", "--max-new-tokens", "8", "--json"])
    assert exit_info.value.code == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["text"].strip() == "hello there" and record["finish_reason"] == "stop"


@pytest.mark.slow
def test_reinit_tokens_redraws_their_rows_when_the_run_starts(base_model, tmp_path, capsys):
    """Levanter's ``reinit_tokens``: the named tokens' embedding rows are drawn afresh (here the
    added ``<unk>``, which the data never shows, so its row is still the drawn one at the end)."""
    import torch
    import transformers

    from levanter_core.run import run_training

    config = sft_config(tmp_path, base_model, reinit_tokens=["<unk>"], reinit_lm_head=False)
    config["trainer"]["num_train_steps"] = 2
    path = write_config(tmp_path, config, "sft.yaml")
    run_training(load_train_config(path)[0], config_path=path, progress=False)
    assert "re-drew the embedding and output rows of <unk>" in capsys.readouterr().out

    base = transformers.AutoModelForCausalLM.from_pretrained(base_model).get_input_embeddings().weight.detach()
    rows = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf" / "sft" / "step-2"))
    rows = rows.get_input_embeddings().weight.detach()
    pad, unk = base.shape[0], base.shape[0] + 1
    torch.testing.assert_close(rows[pad], base.mean(dim=0), atol=1e-6, rtol=0)  # added, not re-drawn: the mean
    assert not torch.allclose(rows[unk], base.mean(dim=0), atol=1e-3)  # re-drawn ...
    assert abs(rows[unk].norm() / base.norm(dim=1).mean() - 1) < 0.5  # ... with the others' spread


def test_an_unknown_reinit_token_is_refused_before_training(base_model, tmp_path):
    from levanter_core.run import run_training

    path = write_config(tmp_path, sft_config(tmp_path, base_model, reinit_tokens=["<|eot_id|>"]), "sft.yaml")
    with pytest.raises(ConfigError, match=r"special_tokens.reinit_tokens: '<\|eot_id\|>' is not a token"):
        run_training(load_train_config(path)[0], config_path=path, progress=False)
