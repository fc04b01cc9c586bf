"""``levanter sample``: prompts in, text (or JSON lines with token ids and log-probabilities)
out, from a Hugging Face directory or our import of it; seeds, stop strings, samples per
prompt, the chat template, Levanter's sampler configs, and errors for bad requests."""

import json
import os

import pytest

from levanter_core.cli import main

SAMPLER_CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "levanter-configs", "config", "sampler")
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama with a byte-level BPE tokenizer (and a chat template) beside it."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from levanter_core.hf.parity import random_hf_model

    directory = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = ["the quick brown fox jumps over the lazy dog", "four score and seven years ago our fathers"] * 20
    tokenizer.train_from_iterator(
        text,
        trainers.BpeTrainer(
            vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    with open(directory / "tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "chat_template": TEMPLATE}, f)
    hf_config = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, eos_token_id=0,
    )  # fmt: skip
    random_hf_model(hf_config, seed=1).save_pretrained(directory)
    return str(directory)


def sample(capsys, *args) -> tuple[int, list]:
    """Run ``levanter sample ARGS`` in this process: its exit status and its JSON lines (or text)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["sample", *args])
    out, err = capsys.readouterr()
    if exit_info.value.code != 0:
        return exit_info.value.code, err
    lines = out.strip().splitlines()
    return 0, [json.loads(line) for line in lines] if "--json" in args else out


def test_greedy_json_lines_carry_tokens_and_log_probabilities(model_dir, capsys):
    code, records = sample(capsys, model_dir, "--prompt", "the quick", "--prompt", "four score and seven",
                           "--temperature", "0", "--max-new-tokens", "10", "--json")  # fmt: skip
    assert code == 0 and [r["prompt"] for r in records] == ["the quick", "four score and seven"]
    for r in records:
        assert 1 <= len(r["tokens"]) <= 10 and len(r["logprobs"]) == len(r["tokens"])
        assert all(lp <= 0 for lp in r["logprobs"]) and r["finish_reason"] in ("stop", "length")
        assert isinstance(r["text"], str)
    # greedy is greedy: the same again, and the same from our import of the model
    assert sample(capsys, model_dir, "--prompt", "the quick", "--prompt", "four score and seven",
                  "--temperature", "0", "--max-new-tokens", "10", "--json")[1] == records  # fmt: skip


def test_an_import_samples_as_its_hugging_face_directory(model_dir, tmp_path, capsys):
    assert main_ok(["import-hf", model_dir, str(tmp_path / "imported")])
    capsys.readouterr()
    args = ("--prompt", "the lazy dog", "--temperature", "0", "--max-new-tokens", "12", "--json")
    assert sample(capsys, str(tmp_path / "imported"), *args) == sample(capsys, model_dir, *args)


def main_ok(argv) -> bool:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code == 0


def test_the_same_seed_gives_the_same_text_and_n_gives_several(model_dir, capsys):
    args = (model_dir, "--prompt", "over the", "--temperature", "1.0", "--max-new-tokens", "16", "-n", "3", "--json")
    first = sample(capsys, *args, "--seed", "7")[1]
    assert [r["sample"] for r in first] == [0, 1, 2]
    assert len({tuple(r["tokens"]) for r in first}) > 1  # the samples differ from each other
    assert sample(capsys, *args, "--seed", "7")[1] == first
    assert sample(capsys, *args, "--seed", "8")[1] != first


def test_a_stop_string_ends_the_text_before_it(model_dir, capsys):
    base = (model_dir, "--prompt", "the", "--temperature", "1.0", "--seed", "3", "--max-new-tokens", "24", "--json")
    full = sample(capsys, *base)[1][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    cut = sample(capsys, *base, "--stop", stop)[1][0]
    assert cut["text"] == full[: full.index(stop)] and cut["finish_reason"] == "stop"


def test_chat_puts_the_prompt_through_the_template(model_dir, capsys):
    from levanter_core.data.tokenizer import load_tokenizer

    record = sample(capsys, model_dir, "--prompt", "hi", "--chat", "--max-new-tokens", "4", "--json")[1][0]
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer.decode(record["prompt_tokens"]) == "[user] hi\n[assistant]"


def test_prompts_file_and_plain_output(model_dir, tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text('"the quick"\n{"prompt": "four"}\n{"messages": [{"role": "user", "content": "yo"}]}\n')
    code, out = sample(capsys, model_dir, "--prompts", str(path), "--max-new-tokens", "4", "--temperature", "0")
    assert code == 0 and out.count("--- (") == 3 and "the quick" in out


def test_levanters_sampler_configs_load_and_run(model_dir, capsys):
    from levanter_core.inference.sample import load_sample_config

    if not os.path.isdir(SAMPLER_CONFIGS):
        pytest.skip("Levanter's configs are not beside the repository")
    big = load_sample_config(os.path.join(SAMPLER_CONFIGS, "sample_llama8b.yaml"))
    assert big.hf_checkpoint == "meta-llama/Llama-3.1-8B" and big.engine.max_seqs == 256 and big.profile
    nano = os.path.join(SAMPLER_CONFIGS, "sample_nano.yaml")
    config = load_sample_config(nano)
    assert config.max_new_tokens == 32 and len(config.prompts) == 2 and config.engine.max_seqs == 8
    assert config.engine.max_seq_len(4096) == 128  # 8 positions a page, 16 pages
    # the config's prompts and settings, on our tiny model (its hub model is not here, offline)
    code, records = sample(capsys, model_dir, "--config", nano, "--tokenizer", model_dir, "--json",
                           "--max-new-tokens", "5", "--engine.max_seqs", "2")  # fmt: skip
    assert code == 0 and [r["prompt"] for r in records] == config.prompts


@pytest.mark.parametrize(
    "args, message",
    [
        (("--prompt", "the " * 150), "this model's context is 128 tokens"),
        (("--prompt", "the", "--max-new-tokens", "200"), "more than this model's context of 128 tokens"),
        (
            ("--prompt", "the", "--temperature", "-1"),
            "--temperature: temperature must be a number from 0 (greedy) to 100",
        ),
        ((), "give at least one --prompt"),
    ],
)
def test_bad_requests_exit_2_with_the_reason(model_dir, capsys, args, message):
    code, err = sample(capsys, model_dir, *args)
    assert code == 2 and message in err and "Traceback" not in err


def test_a_bad_prompts_line_is_named(model_dir, tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text('"fine"\n{"text": 3}\n')
    code, err = sample(capsys, model_dir, "--prompts", str(path))
    assert code == 2 and f"{path}, line 2" in err


def test_a_source_that_is_no_model_is_refused(tmp_path, capsys):
    code, err = sample(capsys, str(tmp_path), "--prompt", "x")
    assert code == 2 and "neither one of our checkpoints" in err


@pytest.mark.parametrize(
    "args, option, allowed",
    [
        (("--top-k", "3000000000"), "--top-k", "0 (off) to 2147483647"),
        (("--top-k", "-1"), "--top-k", "0 (off) to 2147483647"),
        (("--top-p", "0"), "--top-p", "(0, 1]"),
        (("--top-p", "nan"), "--top-p", "(0, 1]"),
        (("--temperature", "inf"), "--temperature", "0 (greedy) to 100"),
        (("--temperature", "nan"), "--temperature", "0 (greedy) to 100"),
        (("--seed", str(2**64)), "--seed", "-2**63 to 2**63 - 1"),
        (("--max-new-tokens", "0"), "--max-new-tokens", "at least 1"),
        (("--stop", "x") * 17, "--stop", "at most 16"),
        (("-n", "0"), "-n", "1"),
        (("--max-seqs", "0"), "--max-seqs", "1"),
        (("--top-k", "many"), "--top-k", "integer"),
    ],
)
def test_out_of_range_options_exit_2_with_one_line_naming_them(model_dir, capsys, args, option, allowed):
    code, err = sample(capsys, model_dir, "--prompt", "the", *args)
    assert code == 2 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and option in err and allowed in err, err


def test_seeds_select_streams_by_all_their_bits(model_dir, capsys):
    """Seeds that agree modulo 2**32 used to draw the same text."""
    args = (model_dir, "--prompt", "over the", "--temperature", "1.0", "--max-new-tokens", "16", "--json")
    texts = {seed: sample(capsys, *args, "--seed", str(seed))[1][0]["tokens"] for seed in (1, 2**32 + 1, -(2**63))}
    assert texts[1] != texts[2**32 + 1]
    assert sample(capsys, *args, "--seed", str(-(2**63)))[1][0]["tokens"] == texts[-(2**63)]


def test_stop_strings_read_backslash_escapes(model_dir, capsys):
    """``--stop "\\n\\n"`` (as docs/generation.md shows it) is two newlines, not backslash-n twice."""
    from levanter_core.inference.sample import interpret_escapes

    assert interpret_escapes("\\n\\n", "--stop") == "\n\n"
    assert interpret_escapes("a\\\\nb", "--stop") == "a\\nb"  # an escaped backslash stays one
    base = (model_dir, "--prompt", "the", "--temperature", "1.0", "--seed", "3", "--max-new-tokens", "24", "--json")
    full = sample(capsys, *base)[1][0]["text"]
    char = full[len(full) // 2]
    cut = sample(capsys, *base, "--stop", f"\\u{ord(char):04x}")[1][0]
    assert cut["text"] == full[: full.index(char)] and cut["finish_reason"] == "stop"
    code, err = sample(capsys, *base, "--stop", "\\ud800")
    assert code == 2 and "is not a Unicode character" in err


def test_text_that_is_not_unicode_is_refused_by_name(model_dir, tmp_path, capsys):
    code, err = sample(capsys, model_dir, "--prompt", "caf\udce9")  # argv bytes that are not UTF-8
    assert code == 2 and "lone surrogate" in err and "Traceback" not in err
    path = tmp_path / "prompts.jsonl"
    path.write_text('"fine"\n"\\ud800"\n')
    code, err = sample(capsys, model_dir, "--prompts", str(path))
    assert code == 2 and f"{path}, line 2" in err and "lone surrogate" in err
