"""Levanter's example programs ``alpaca``, ``alpaca_lora`` and ``gsm8k_lora``: their configs load
through ``levanter train`` and mean what they mean in Levanter (prompts, data, model, LoRA, exports),
the ``supervised`` format's prompt templates that carry them, and an ``alpaca-lora`` config that
trains adapters, on the outputs only, on a tiny local Llama."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from levanter_core.config.levanter_examples import ALPACA_PROMPTS, is_levanter_example
from levanter_core.config.loader import load_config_dict
from levanter_core.config.train import load_train_config
from levanter_core.data.formats import SupervisedFormat
from levanter_core.data.tokenizer import load_tokenizer
from levanter_core.errors import ConfigError, DataError
from levanter_core.lora import LoraConfig
from levanter_core.testing import train_bpe_tokenizer, write_jsonl

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "levanter-configs"
needs_reference = pytest.mark.skipif(not REFERENCE.is_dir(), reason=f"Levanter's configs are not at {REFERENCE}")
EXAMPLES = ("examples/alpaca/", "examples/alpaca-lora/", "examples/gsm8k-lora/")
CONFIGS = sorted(
    p.relative_to(REFERENCE).as_posix()
    for folder in EXAMPLES
    for p in (REFERENCE / folder).glob("*.yaml")
) if REFERENCE.is_dir() else []  # fmt: skip

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven"]
RECORDS = [
    {"instruction": f"Write the number {i} in words", "input": "" if i % 3 == 0 else f"the number is {i}", "output": word}
    for i, word in enumerate(WORDS)
]  # fmt: skip
GSM8K = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "Ann had 10 pens and gave away 2. How many?", "answer": "10 - 2 = <<10-2=8>>8\n#### 8"},
] * 4


def _load(relative: str, overrides: list[str] | None = None):
    return load_train_config(str(REFERENCE / relative), overrides)[0]


def _source(config):
    return config.data.configs["main"]


# -- the supervised format's templates ---------------------------------------------------------------


def test_templates_make_the_prompt_and_an_empty_input_picks_prompt_no_input():
    tok = load_tokenizer("byte")
    fmt = SupervisedFormat(input_field="input", output_field="output", prompt_input="I: {instruction} [{input}] =",
                           prompt_no_input="I: {instruction} =")  # fmt: skip
    records = [{"instruction": "add", "input": "1 1", "output": "2"}, {"instruction": "hi", "output": "yo"},
               {"instruction": "hi", "input": None, "output": "yo"}, {"instruction": "hi", "input": "", "output": "yo"}]  # fmt: skip
    encoded = fmt.encode_batch(records, [f"d.jsonl:{i}" for i in range(1, 5)], tok, tok.eos_id)
    texts = [tok.decode(e.ids) for e in encoded]
    assert texts == ["I: add [1 1] =2<|endoftext|>"] + ["I: hi =yo<|endoftext|>"] * 3
    assert [tok.decode(e.ids[e.target_mask == 1]) for e in encoded] == ["2<|endoftext|>"] + ["yo<|endoftext|>"] * 3
    # without prompt_no_input the one template serves every record that has the fields it names
    only = SupervisedFormat(input_field="input", output_field="output", prompt_input="{instruction}:{input}=")
    empty, missing = only.encode_batch([records[3], records[1]], ["d:4", "d:2"], tok, None)
    assert tok.decode(empty.ids) == "hi:=yo" and "d:2: format.prompt_input names the field 'input'" in str(missing)


def test_a_template_naming_a_field_the_record_lacks_is_bad_data_with_its_line():
    fmt = SupervisedFormat(output_field="output", prompt_input="{instruction} / {context}")
    (bad,) = fmt.encode_batch([{"instruction": "x", "output": "y"}], ["alpaca.json:7"], load_tokenizer("byte"), None)
    assert isinstance(bad, DataError)
    assert (
        str(bad)
        == "alpaca.json:7: format.prompt_input names the field 'context', which the record lacks (the record's fields: 'instruction', 'output')"
    )


@pytest.mark.parametrize(("template", "message"), [("{instruction", "not a valid template"), ("{} =", "filled by name"),
                                                   ("{0} =", "filled by name")])  # fmt: skip
def test_a_template_that_cannot_be_filled_by_name_is_refused(template, message):
    with pytest.raises(ValidationError, match=message):
        SupervisedFormat(prompt_input=template)


def test_output_replacements_and_suffix_are_trained_on():
    tok = load_tokenizer("byte")
    fmt = SupervisedFormat(input_field="q", output_field="a", prompt_input="Q: {q}\nA: ",
                           output_replacements=[["####", "The answer is"], ["\n", " "]], output_suffix=".\n")  # fmt: skip
    (e,) = fmt.encode_batch([{"q": "1+1?", "a": "1+1=2\n#### 2"}], ["g:1"], tok, tok.eos_id)
    assert tok.decode(e.ids) == "Q: 1+1?\nA: 1+1=2 The answer is 2.\n<|endoftext|>"
    assert tok.decode(e.ids[e.target_mask == 1]) == "1+1=2 The answer is 2.\n<|endoftext|>"


def test_unset_templates_leave_the_cache_key_as_it_was():
    """Caches built before the template fields existed are keyed by these five fields only."""
    assert SupervisedFormat(separator="\n").fingerprint() == {
        "type": "supervised", "input_field": "prompt", "output_field": "response", "separator": "\n", "mask_inputs": True,
    }  # fmt: skip
    assert SupervisedFormat(prompt_input="{prompt}").fingerprint() != SupervisedFormat().fingerprint()
    assert SupervisedFormat(output_suffix=".").fingerprint()["output_suffix"] == "."


# -- which configs are these programs' -----------------------------------------------------------------


@needs_reference
def test_only_the_example_programs_configs_are_read_as_theirs():
    found = []
    for path in sorted(REFERENCE.rglob("*.yaml")):
        try:
            raw, _ = load_config_dict(str(path))
        except ConfigError:
            continue  # (fragments that include what is not there)
        if is_levanter_example(raw):
            found.append(path.relative_to(REFERENCE).as_posix())
    assert sorted(found) == CONFIGS and len(found) == 6


def test_a_training_config_is_never_read_as_an_example():
    repo = Path(__file__).resolve().parents[1]
    for path in sorted((repo / "config").glob("*.yaml")):
        raw, _ = load_config_dict(str(path))
        assert not is_levanter_example(raw), path
    assert not is_levanter_example({"data": {"train_urls": ["x"]}, "model_name_or_path": "m"})
    assert not is_levanter_example({"supervised_data": {"cache_dir": "c"}, "data_cache_dir": "c"})  # sft's


@pytest.mark.parametrize(
    ("name", "extra", "lora"),
    [("run.yaml", {}, False), ("exploration.yaml", {}, False), ("lora/run.yaml", {}, False), ("my-lora.yaml", {}, True),
     ("alpaca-lora/run.yaml", {}, True),
     ("my-lora.yaml", {"lora": None}, False), ("run.yaml", {"lora": {"r": 4}}, True),
     ("run.yaml", {"merged_hf_save_path": "merged"}, True)],
)  # fmt: skip
def test_alpaca_or_alpaca_lora_by_the_lora_section_or_the_files_name(tmp_path, name, extra, lora):
    """Levanter's ``alpaca.yaml`` and ``alpaca-lora.yaml`` differ only in the program run on them."""
    folder = tmp_path / "configs"  # (tmp_path's own name has this test's words)
    (folder / name).parent.mkdir(parents=True)
    config, _ = load_train_config(_write(folder, {"model_name_or_path": "org/model", **extra}, name))
    assert (config.lora is not None) == lora
    assert (config.peft_save_path, config.hf_save_path) == (
        ("alpaca_hf_ckpts", extra.get("merged_hf_save_path")) if lora else (None, "alpaca_hf_ckpts")
    )
    assert config.data.effective_shuffle is not lora


# -- Levanter's configs, as they are ---------------------------------------------------------------------


@needs_reference
@pytest.mark.parametrize("relative", CONFIGS or ["none"])
def test_each_example_config_loads(relative):
    config = _load(relative)
    assert config.initialize_from_hf and config.use_hf_model_config and config.model.seq_len == 2048
    assert _source(config).format.type == "supervised" and _source(config).type == "hf"
    assert config.hf_save_steps == 1000 and config.trainer.num_train_steps > 0
    assert (config.lora is not None) == ("lora" in relative)


@needs_reference
def test_alpaca_configs_mean_full_fine_tuning_with_alpacas_prompts():
    config = _load("examples/alpaca/alpaca.yaml")
    source = _source(config)
    assert config.initialize_from_hf == "huggyllama/llama-7b" and config.model.type == "llama"
    assert config.data.tokenizer == 'huggyllama/llama-7b+{"add_missing_defaults": true}'  # [PAD] etc. where missing
    assert (source.id, source.train_split, source.validation_split, source.stream) == (
        "tatsu-lab/alpaca",
        "train",
        None,
        True,
    )
    assert config.data.cache_dir == "cache/" and config.data.effective_shuffle is True
    fmt = source.format
    assert (fmt.input_field, fmt.output_field, fmt.mask_inputs) == ("input", "output", True)
    assert {
        "prompt_input": fmt.prompt_input,
        "prompt_no_input": fmt.prompt_no_input,
    } == ALPACA_PROMPTS  # as the file writes them
    assert config.lora is None and config.hf_save_path == "alpaca_hf_ckpts" and config.peft_save_path is None
    assert (config.optimizer.learning_rate, config.optimizer.weight_decay) == (2e-5, 0.0)
    assert (config.trainer.num_train_steps, config.trainer.train_batch_size) == (1218, 128)
    llama2 = _load("examples/alpaca/alpaca-llama2.yaml")
    assert llama2.initialize_from_hf == "NousResearch/Llama-2-7b-hf" and _source(llama2).format == fmt


@needs_reference
def test_alpaca_lora_configs_mean_adapters_and_peft_exports():
    config = _load("examples/alpaca-lora/alpaca-lora.yaml")
    assert config.lora == LoraConfig() and (config.lora.r, config.lora.alpha) == (8, 8.0)  # LoraConfig() by default
    assert config.peft_save_path == "alpaca_hf_ckpts" and config.hf_save_path is None  # hf_save_path: the adapters
    assert config.data.tokenizer == "huggyllama/llama-7b"  # no tokens added (unreadable offline: the roles as they are)
    assert config.data.effective_shuffle is False  # alpaca_lora reads its examples in order
    assert config.optimizer.learning_rate == 3e-4 and config.trainer.num_train_steps == 1218
    assert {
        "prompt_input": _source(config).format.prompt_input,
        "prompt_no_input": _source(config).format.prompt_no_input,
    } == ALPACA_PROMPTS

    code = _load("examples/alpaca-lora/code-alpaca-lora.yaml")
    source = _source(code)
    assert source.id == "lucasmccabe-lmi/CodeAlpaca-20k" and code.data.cache_dir == "code_alpaca_cache"
    assert source.format.prompt_input == "### Instruction: {instruction}\n### Input: {input}\n### Output:"
    assert source.format.prompt_no_input == "### Instruction: {instruction}\n### Output:"
    assert code.trainer.num_train_steps == 500 and code.lora == LoraConfig()

    merged = _load(
        "examples/alpaca-lora/alpaca-lora.yaml", ["--merged_hf_save_path", "merged", "--hf_upload", "me/adapter"]
    )
    assert (merged.hf_save_path, merged.peft_save_path, merged.peft_hf_upload) == (
        "merged",
        "alpaca_hf_ckpts",
        "me/adapter",
    )


@needs_reference
def test_gsm8k_config_means_lora_on_gsm8k_with_its_prompt():
    config = _load("examples/gsm8k-lora/gsm8k-llama2.yaml")
    source = _source(config)
    assert (source.id, source.name, source.validation_split) == ("gsm8k", "main", None)
    assert config.data.cache_dir == "gsm8k_cache" and config.data.effective_shuffle is True
    assert (
        config.initialize_from_hf is True and config.hf_source == "NousResearch/Llama-2-7b-hf"
    )  # model.reference_checkpoint's default
    assert config.data.tokenizer == "NousResearch/Llama-2-7b-hf"
    assert (config.lora.r, config.lora.alpha, config.lora.dropout) == (8, 8.0, 0.0)
    assert (config.optimizer.learning_rate, config.optimizer.lr_schedule) == (2e-4, "constant")
    assert (config.trainer.num_train_steps, config.trainer.train_batch_size) == (550, 64)
    assert config.hf_save_path is None and config.peft_save_path is None  # gsm8k_lora saves nothing by default
    tok = load_tokenizer("byte")
    (e,) = source.format.encode_batch([GSM8K[0]], ["gsm8k:1"], tok, tok.eos_id)
    assert (
        tok.decode(e.ids)
        == "Q: Tom has 3 apples and buys 4 more. How many?\nA: 3 + 4 = <<3+4=7>>7 The answer is 7.\n<|endoftext|>"
    )
    assert tok.decode(e.ids[e.target_mask == 1]) == "3 + 4 = <<3+4=7>>7 The answer is 7.\n<|endoftext|>"
    keyed = _load("examples/gsm8k-lora/gsm8k-llama2.yaml", ["--input_key", "problem", "--data_seed", "5"])
    assert _source(keyed).format.prompt_input == "Q: {problem}\nA: " and keyed.data_seed == 5


# -- bad input: the field as the file wrote it, and its line ----------------------------------------------


def _write(tmp_path: Path, config: dict, name: str = "alpaca.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


def _line(path: str, key: str) -> int:
    return 1 + next(
        i for i, text in enumerate(Path(path).read_text().splitlines()) if text.strip().startswith(key + ":")
    )


@pytest.mark.parametrize(
    ("changes", "field", "where", "message"),
    [
        (
            {"prompts": {"prompt_input": "{instruction", "prompt_no_input": "x"}},
            "data.format.prompt_input",
            "prompt_input",
            "not a valid template",
        ),
        ({"prompts": {"prompt_no_input": "x"}}, "prompts.prompt_input", "prompts", "expected a prompt template"),
        (
            {"prompts": "missing-prompts.json"},
            "prompts",
            "prompts",
            "cannot read the prompts from missing-prompts.json",
        ),
        ({"data": "train.parquet"}, "data", "data", "only a Hugging Face dataset id or a .json or .jsonl file"),
        ({"model_cache_dir": "/tmp/models"}, "model_cache_dir", "model_cache_dir", "only null"),
        ({"mask_inputs": "sometimes"}, "data.format.mask_inputs", "mask_inputs", "boolean"),
        ({"hf_upload": True}, "hf_upload", "hf_upload", "name the Hugging Face hub repository"),
    ],
)
def test_a_bad_field_is_named_as_written_with_its_line(tmp_path, monkeypatch, changes, field, where, message):
    monkeypatch.chdir(tmp_path)
    Path("train.parquet").write_bytes(b"")
    path = _write(tmp_path, {"model_name_or_path": str(tmp_path / "model"), "data": "alpaca.json", **changes})
    with pytest.raises(ConfigError) as raised:
        load_train_config(path)
    text = str(raised.value)
    assert field in text and f"alpaca.yaml:{_line(path, where)}" in text and message in text, text


def test_prompts_from_a_json_file(tmp_path):
    prompts = {"prompt_input": "{instruction} ({input}) ->", "prompt_no_input": "{instruction} ->"}
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    path = _write(
        tmp_path, {"model_name_or_path": str(tmp_path), "data": "a.jsonl", "prompts": str(tmp_path / "prompts.json")}
    )
    config, _ = load_train_config(path)
    fmt = _source(config).format
    assert (fmt.prompt_input, fmt.prompt_no_input) == (prompts["prompt_input"], prompts["prompt_no_input"])
    assert _source(config).type == "url" and list(_source(config).train_urls) == ["a.jsonl"]
    (tmp_path / "prompts.json").write_text(json.dumps({"prompt_input": "{0}"}))
    with pytest.raises(
        ConfigError, match=r"data\.format\.prompt_input \(prompts at .*alpaca\.yaml:\d+\).*filled by name"
    ):
        load_train_config(path)


def test_a_bad_example_config_exits_2_without_a_traceback(tmp_path, capsys):
    from levanter_core.cli import main

    path = _write(tmp_path, {"model_name_or_path": "m", "data": "a.jsonl", "prompts": 7})
    with pytest.raises(SystemExit) as exit_info:
        main(["train", path, "--dry-run"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "prompts" in err and "alpaca.yaml:3" in err and "Traceback" not in err


# -- on a tiny local Llama ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> str:
    """A tiny random Llama whose tokenizer has an unknown token but no pad token (as Llama 2's),
    trained on the prompts it will see."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    from levanter_core.hf.parity import random_hf_model

    directory = tmp_path_factory.mktemp("tiny-llama")
    texts = [ALPACA_PROMPTS["prompt_input"].format_map(r) + r["output"] for r in RECORDS] * 10
    path = train_bpe_tokenizer(
        texts, str(directory / "tokenizer.json"), vocab_size=400, special_tokens=("<|endoftext|>", "<unk>")
    )
    special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<unk>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(special))
    tokenizer = Tokenizer.from_file(path)
    eos = tokenizer.token_to_id("<|endoftext|>")
    config = transformers.LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, bos_token_id=eos, eos_token_id=eos)  # fmt: skip
    random_hf_model(config, seed=0).save_pretrained(str(directory))
    return str(directory)


def _run_overrides(tmp_path: Path, base: str, data: str, steps: int) -> list[str]:
    return [
        "--model_name_or_path", base, "--data", data, "--data_cache_dir", str(tmp_path / "cache"),
        "--trainer.num_train_steps", str(steps), "--trainer.train_batch_size", "4", "--trainer.id", "run",
        "--trainer.log_dir", str(tmp_path / "logs"), "--trainer.checkpointer.base_path", str(tmp_path / "ckpt"),
        "--trainer.tensor_parallel_axes", "[]", "--trainer.mp", "p=f32", "--trainer.wandb", "null",
    ]  # fmt: skip


@needs_reference
def test_alpaca_lora_on_a_local_model_uses_the_unknown_token_and_the_models_context(base_model, tmp_path):
    config = _load("examples/alpaca-lora/alpaca-lora.yaml", _run_overrides(tmp_path, base_model, "a.json", 2))
    assert config.data.tokenizer == base_model + '+{"pad_token": "<unk>"}'  # the missing pad is the unknown token
    tokenizer = load_tokenizer(config.data.tokenizer)
    assert tokenizer.vocab_size == load_tokenizer(base_model).vocab_size  # nothing added: the adapters' model fits
    assert config.model.seq_len == 128  # the model's own context (max_position_embeddings)
    shorter = _load(
        "examples/alpaca-lora/alpaca-lora.yaml",
        [*_run_overrides(tmp_path, base_model, "a.json", 2), "--max_tune_length", "64"],
    )
    assert shorter.model.seq_len == 64
    full = _load(
        "examples/alpaca/alpaca.yaml", [*_run_overrides(tmp_path, base_model, "a.json", 2), "--max_tune_length", "96"]
    )
    assert full.model.seq_len == 96 and full.data.tokenizer == base_model + '+{"add_missing_defaults": true}'
    assert load_tokenizer(full.data.tokenizer).added_tokens == ("[PAD]",)  # Levanter's alpaca grows the vocabulary


def test_alpaca_lora_needs_an_unknown_token(tmp_path):
    from levanter_core.data.tokenizer import ByteTokenizer

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer.json").write_text(ByteTokenizer().to_tokenizer_json())
    path = _write(tmp_path, {"model_name_or_path": str(tmp_path / "model"), "data": "a.json", "lora": {"r": 4}})
    with pytest.raises(ConfigError) as raised:
        load_train_config(path)
    assert "model_name_or_path" in str(raised.value) and "has no unknown token" in str(raised.value)
    assert f"alpaca.yaml:{_line(path, 'model_name_or_path')}" in str(raised.value)


@pytest.mark.slow
@needs_reference
def test_alpaca_lora_trains_adapters_on_the_outputs(base_model, tmp_path, monkeypatch):
    """``examples/alpaca-lora/alpaca-lora.yaml`` as Levanter ships it, with only the model (a hub
    name) and the data (the Alpaca dataset on the hub) replaced by local ones: the targets are each
    output and its end-of-text token, only the adapters train, and the adapters are written as a
    PEFT adapter where ``hf_save_path`` says."""
    from levanter_core.checkpoint import read_metadata
    from levanter_core.run import run_training

    monkeypatch.chdir(tmp_path)  # hf_save_path (alpaca_hf_ckpts) is relative
    (tmp_path / "alpaca.json").write_text(json.dumps(RECORDS))  # the original Alpaca's form: one JSON array
    relative = "examples/alpaca-lora/alpaca-lora.yaml"
    config = _load(relative, _run_overrides(tmp_path, base_model, "alpaca.json", 4))

    source = _source(config)
    tokenizer = load_tokenizer(config.data.tokenizer)
    encoded = source.format.encode_batch(
        RECORDS, [f"alpaca.json:{i}" for i in range(len(RECORDS))], tokenizer, tokenizer.eos_id
    )
    assert [tokenizer.decode(e.ids[e.target_mask == 1]) for e in encoded] == [
        r["output"] + "<|endoftext|>" for r in RECORDS
    ]
    assert tokenizer.decode(encoded[0].ids).endswith(
        "### Instruction:\nWrite the number 0 in words\n\n### Response:zero<|endoftext|>"
    )
    assert "### Input:\nthe number is 1" in tokenizer.decode(encoded[1].ids)

    result = run_training(config, config_path=str(REFERENCE / relative), progress=False)
    assert result.final_step == 4 and result.last_loss is not None
    described = read_metadata(str(tmp_path / "ckpt" / "run" / "step-4"))
    model_leaves = [leaf["name"] for leaf in described["leaves"] if leaf["name"].startswith("model/")]
    assert model_leaves and all("/lora/" in name for name in model_leaves)  # only the adapters were trained and saved
    adapter = tmp_path / "alpaca_hf_ckpts" / "run" / "step-4"
    adapter_config = json.loads((adapter / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == base_model and adapter_config["r"] == 8
    assert (adapter / "adapter_model.safetensors").exists()


@pytest.mark.slow
@needs_reference
def test_gsm8k_lora_trains_on_local_data(base_model, tmp_path, monkeypatch):
    from levanter_core.run import run_training

    monkeypatch.chdir(tmp_path)
    data = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)
    relative = "examples/gsm8k-lora/gsm8k-llama2.yaml"
    overrides = _run_overrides(tmp_path, base_model, data, 2)[2:]  # gsm8k_lora's model is model.reference_checkpoint
    config = _load(relative, [*overrides, "--model.reference_checkpoint", base_model, "--max_tune_length", "64"])
    assert config.hf_source == base_model and config.data.tokenizer == base_model and config.model.seq_len == 64
    result = run_training(config, config_path=str(REFERENCE / relative), progress=False)
    assert result.final_step == 2
    assert not os.path.exists(tmp_path / "alpaca_hf_ckpts")  # gsm8k_lora exports nothing unless asked


@pytest.mark.slow
@needs_reference
def test_alpaca_fine_tunes_the_whole_model_grown_by_a_pad_token(base_model, tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from levanter_core.run import run_training

    monkeypatch.chdir(tmp_path)
    data = write_jsonl(tmp_path / "alpaca.jsonl", RECORDS)
    relative = "examples/alpaca/alpaca.yaml"
    config = _load(relative, [*_run_overrides(tmp_path, base_model, data, 2), "--max_tune_length", "128"])
    assert config.lora is None
    result = run_training(config, config_path=str(REFERENCE / relative), progress=False)
    assert result.final_step == 2
    exported = tmp_path / "alpaca_hf_ckpts" / "run" / "step-2"  # hf_save_path's default: the whole model
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(exported))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(exported))
    base_vocab = transformers.AutoConfig.from_pretrained(base_model).vocab_size
    assert tokenizer.pad_token == "[PAD]" and model.config.vocab_size == len(tokenizer) == base_vocab + 1
