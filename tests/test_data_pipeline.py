"""The data pipeline end to end: `levanter cache`, training that starts before its cache
is complete, mixtures with per-source evaluation, chat data packed with segment-aware
attention, and bad data through the CLI."""

import json
import os

import numpy as np
import pytest
from slow_source import SlowSourcePlugin

import levanter_core.plugins as plugins
from conftest import code_docs, metrics, run_cli, run_config, write_jsonl
from levanter_core.config.train import load_train_config
from levanter_core.data.pipeline import build_caches, build_lm_data, caches_complete
from levanter_core.run import run_training


def prose_docs(n):
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "slept"]
    return [{"text": " ".join(words[(i + j) % len(words)] for j in range(30)) + "."} for i in range(n)]


def ledger(path):
    with open(os.path.join(path, "ledger.json")) as f:
        return json.load(f)


@pytest.fixture
def slow_source():
    plugins.reset()
    plugins.register_plugin(SlowSourcePlugin(), name="slow-source")
    yield
    plugins.reset()


@pytest.mark.slow
def test_training_starts_before_the_cache_is_complete_and_reads_the_same_batches(tmp_path, slow_source):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    for shard in range(10):
        write_jsonl(data_dir / f"train-{shard}.jsonl", code_docs(40, offset=40 * shard))
    write_jsonl(data_dir / "valid.jsonl", code_docs(10, offset=1000))
    data = {
        "type": "slow_url",
        "seconds_per_shard": 1.5,
        "train_urls": [str(data_dir / "train-{0..9}.jsonl")],
        "validation_urls": [str(data_dir / "valid.jsonl")],
        "cache_dir": str(tmp_path / "cache"),
        "shuffle": False,
    }
    config, _ = load_train_config(run_config(tmp_path, data, steps=8))

    run_training(config, progress=False)

    logged = metrics(tmp_path)
    # Every step trained while the cache held only part of the documents; the run's end
    # stopped the build, which the ledger shows unfinished.
    assert logged[1]["step"] == 1 and logged[1]["data/main/train_documents_cached"] < 400
    assert not ledger(tmp_path / "cache" / "train")["complete"]
    # Finished (as `levanter cache` does), the same run reads exactly the same batches.
    for _ in build_caches(config.data, progress=False):
        pass
    assert ledger(tmp_path / "cache" / "train")["num_documents"] == 400
    again, _ = load_train_config(run_config(tmp_path, data, run_id="again", steps=8))
    run_training(again, progress=False)
    assert [m["train/loss"] for m in metrics(tmp_path, "again") if "train/loss" in m] == [
        m["train/loss"] for m in logged if "train/loss" in m
    ]


def test_cache_command_builds_ahead_with_progress_and_training_reuses_it(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    data = {
        "train_urls": [write_jsonl(data_dir / "train.jsonl", code_docs(200))],
        "validation_urls": [write_jsonl(data_dir / "valid.jsonl", code_docs(20, offset=500))],
        "cache_dir": str(tmp_path / "cache"),
    }
    config = run_config(tmp_path, data, steps=2)

    built = run_cli("cache", config)

    assert built.returncode == 0, built.stderr
    assert "train: 200 documents" in built.stdout and "validation: 20 documents" in built.stdout
    assert "tokens/s" in built.stderr  # the progress bar
    stamp = os.stat(tmp_path / "cache" / "train" / "ledger.json").st_mtime_ns
    # (the runs train in this process: `levanter train` itself is shown elsewhere)
    assert run_training(load_train_config(config)[0], progress=False).final_step == 2
    # Another sequence length cuts the same cache differently: nothing is tokenized again.
    shorter, _ = load_train_config(config, ["--model.seq_len", "16", "--trainer.id", "short"])
    assert run_training(shorter, progress=False).final_step == 2
    assert os.stat(tmp_path / "cache" / "train" / "ledger.json").st_mtime_ns == stamp


def mixture_data(tmp_path, weights):
    """Two sources, code and prose; their files are written the first time only."""
    data_dir = tmp_path / "data"
    if not data_dir.exists():
        data_dir.mkdir()
        write_jsonl(data_dir / "code.jsonl", code_docs(120))
        write_jsonl(data_dir / "code-val.jsonl", code_docs(12, offset=900))
        write_jsonl(data_dir / "prose.jsonl", prose_docs(120))
        write_jsonl(data_dir / "prose-val.jsonl", prose_docs(12))
    return {
        "cache_dir": str(tmp_path / "cache"),
        "configs": {
            name: {
                "train_urls": [str(data_dir / f"{name}.jsonl")],
                "validation_urls": [str(data_dir / f"{name}-val.jsonl")],
            }
            for name in ("code", "prose")
        },
        "train_weights": weights,
        "mixture_block_size": 8,
    }


MIXTURE_WEIGHTS = {"code": 0.75, "prose": 0.25}


@pytest.fixture(scope="module")
def mixture_run(tmp_path_factory):
    """A 6-step run on :func:`mixture_data` (``MIXTURE_WEIGHTS``), trained once for this module:
    its directory (data, caches, logs), which the tests read and never change."""
    tmp_path = tmp_path_factory.mktemp("mixture")
    config, _ = load_train_config(run_config(tmp_path, mixture_data(tmp_path, MIXTURE_WEIGHTS)))
    run_training(config, progress=False)
    return tmp_path


def test_caches_complete_says_whether_a_run_would_tokenize_anything(tmp_path, mixture_run):
    """What a multi-process run asks before starting a Ray cluster: the four caches that
    ``mixture_run`` built are complete; in another cache_dir, or for other inputs, there is
    tokenizing to do."""

    def complete(data) -> bool:
        return caches_complete(load_train_config(run_config(tmp_path, data))[0].data)

    assert complete(mixture_data(mixture_run, MIXTURE_WEIGHTS))
    assert not complete({**mixture_data(mixture_run, MIXTURE_WEIGHTS), "cache_dir": str(tmp_path / "cache")})
    other = mixture_data(mixture_run, MIXTURE_WEIGHTS)
    other["configs"]["prose"]["train_urls"] = [str(write_jsonl(tmp_path / "prose.jsonl", prose_docs(121)))]
    assert not complete(other)


def test_mixture_logs_each_sources_eval_loss_and_new_weights_reuse_the_caches(tmp_path, mixture_run):
    evals = [m for m in metrics(mixture_run) if "eval/loss" in m]
    assert [m["step"] for m in evals] == [0, 3, 6]
    for m in evals:
        assert {"eval/code/loss", "eval/prose/loss"} <= set(m)
        assert (
            min(m["eval/code/loss"], m["eval/prose/loss"])
            <= m["eval/loss"]
            <= max(m["eval/code/loss"], m["eval/prose/loss"])
        )
    caches = [mixture_run / "cache" / name / split for name in ("code", "prose") for split in ("train", "validation")]
    stamps = [os.stat(c / "ledger.json").st_mtime_ns for c in caches]

    staged = [[0, {"code": 0.0, "prose": 1.0}], [3, {"code": 1.0, "prose": 0.0}]]
    other, _ = load_train_config(run_config(tmp_path, mixture_data(mixture_run, staged), run_id="staged"))
    data = build_lm_data(other.data, seq_len=32, seed=0, progress=False)
    try:
        prose_only, code_only = data.train.batch(0, 8), data.train.batch(3, 8)
    finally:
        data.close()
    # Prose has no digits; every 32 bytes of the code has some.
    has_digit = [
        [any(ch.isdigit() for ch in data.tokenizer.decode(row)) for row in b.tokens] for b in (prose_only, code_only)
    ]
    assert has_digit == [[False] * 8, [True] * 8]
    assert [os.stat(c / "ledger.json").st_mtime_ns for c in caches] == stamps  # nothing re-tokenized


def chat_records(n):
    records = []
    for i in range(n):
        records.append(
            {
                "messages": [
                    {"role": "user", "content": f"what is {i} plus {i}?"},
                    {"role": "assistant", "content": f"{2 * i}"},
                ]
            }
        )
    return records


def test_chat_data_is_packed_with_segments_and_trains_only_on_answers(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    data = {
        "train_urls": [write_jsonl(data_dir / "chat.jsonl", chat_records(200))],
        "validation_urls": [write_jsonl(data_dir / "chat-val.jsonl", chat_records(10))],
        "format": {"type": "chat"},
        "cache_dir": str(tmp_path / "cache"),
    }
    config, _ = load_train_config(run_config(tmp_path, data, steps=4))
    lm_data = build_lm_data(config.data, seq_len=128, seed=0, progress=False)
    try:
        batch = lm_data.train.batch(0, 4)
    finally:
        lm_data.close()

    assert batch.segment_ids is not None and all(len(set(row[row > 0])) >= 2 for row in batch.segment_ids)
    # The positions whose next token is trained on predict exactly the assistants' answers.
    for tokens, mask in zip(batch.tokens, batch.loss_mask):
        targets = tokens[1:][mask[:-1] > 0]
        text = lm_data.tokenizer.decode(targets)
        assert "plus" not in text and "user" not in text
        assert any(ch.isdigit() for ch in text)

    run_training(config, progress=False)
    losses = [m["train/loss"] for m in metrics(tmp_path) if "train/loss" in m]
    assert len(losses) == 4 and all(np.isfinite(losses))


def test_a_bad_line_stops_the_run_with_file_and_line_unless_skipping(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    lines = [json.dumps(d) for d in code_docs(100)]
    lines[41] = '{"text": "unterminated'
    (data_dir / "train.jsonl").write_text("\n".join(lines) + "\n")
    data = {"train_urls": [str(data_dir / "train.jsonl")], "cache_dir": str(tmp_path / "cache")}
    config = run_config(tmp_path, data, steps=2)

    failed = run_cli("train", config, "--no-progress")

    assert failed.returncode == 2
    assert f"{data_dir / 'train.jsonl'}:42: not valid JSON" in failed.stderr
    assert "Traceback" not in failed.stderr
    # a run stopped by its data before its first step leaves no run or checkpoint directory behind
    assert not (tmp_path / "ckpt" / "pipe").exists() and not (tmp_path / "logs" / "pipe").exists()

    # (trained in this process: the CLI's part, its message, is above)
    skipping, _ = load_train_config(
        config, ["--data.skip_bad_data", "true", "--data.cache_dir", str(tmp_path / "cache2")]
    )
    assert run_training(skipping, progress=False).final_step == 2
    assert any(m.get("data/skipped/main/train") == 1 for m in metrics(tmp_path))


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_packed_examples_do_not_attend_across_their_boundary(model_type):
    """The second of two packed examples is computed as if it were alone: identical for a
    rotary model (positions are relative); for GPT-2's absolute positions, unchanged by
    what the first example holds."""
    import haliax as hax
    import jax

    from levanter_core.config.base import validate_section
    from levanter_core.models.lm import LmExample, _attn_kwargs

    fields = {"type": model_type, "hidden_dim": 32, "num_heads": 2, "num_layers": 2, "seq_len": 16}
    if model_type == "llama":
        fields.update(intermediate_dim=64, num_kv_heads=2)
    config = validate_section("model", fields)
    Vocab = hax.Axis("vocab", 64)
    model = config.build(Vocab, key=jax.random.PRNGKey(0))
    Pos = config.Pos
    rng = np.random.default_rng(0)
    first, second = rng.integers(0, 64, 6), rng.integers(0, 64, 10)
    other_first = rng.integers(0, 64, 6)

    def hidden(tokens, segments):
        example = LmExample(
            hax.named(np.asarray(tokens, np.int32), (Pos,)),
            segment_ids=hax.named(np.asarray(segments, np.int32), (Pos,)),
        )
        return model.activations(example.tokens, **_attn_kwargs(example)).array

    packed = hidden(np.concatenate([first, second]), [1] * 6 + [2] * 10)
    if model_type == "llama":
        alone = hidden(np.concatenate([second, first]), [1] * 10 + [2] * 6)
        np.testing.assert_allclose(packed[6:], alone[:10], atol=2e-5)
    repacked = hidden(np.concatenate([other_first, second]), [1] * 6 + [2] * 10)
    np.testing.assert_allclose(packed[6:], repacked[6:], atol=2e-5)
    unsegmented = model.activations(hax.named(np.concatenate([first, second]).astype(np.int32), (Pos,))).array
    assert np.abs(unsegmented[6:] - packed[6:]).max() > 1e-3  # without segments, the second sees the first


@pytest.mark.parametrize(
    "lines, expected",
    [
        (["", "  "], "the train split has no documents: its inputs"),
        ([json.dumps({"text": "short"})], "holds 6 tokens, not one sequence of seq_len 32"),
    ],
    ids=["empty", "shorter-than-a-sequence"],
)
def test_too_little_data_is_an_error_before_training(tmp_path, lines, expected):
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    data = {"train_urls": [str(tmp_path / "train.jsonl")], "cache_dir": str(tmp_path / "cache")}

    result = run_cli("train", run_config(tmp_path, data, steps=2), "--no-progress")

    assert result.returncode == 2 and expected in result.stderr
    assert "Traceback" not in result.stderr
    # not one step trained: the run stopped before its run directory was kept
    assert not (tmp_path / "logs" / "pipe").exists() and not (tmp_path / "ckpt" / "pipe").exists()


def test_a_hugging_face_dataset_on_disk_trains_through_the_plugin(tmp_path):
    """``data: {id: <folder>}`` selects levanter-data-hf's source; nothing touches a network."""
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "saved"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(code_docs(100)),
            "validation": datasets.Dataset.from_list(code_docs(10, offset=500)),
        }
    ).save_to_disk(str(folder))
    data = {"id": str(folder), "cache_dir": str(tmp_path / "cache")}
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf-cache")}

    result = run_cli("train", run_config(tmp_path, data, steps=3), "--no-progress", env=env)

    assert result.returncode == 0, result.stderr
    assert ledger(tmp_path / "cache" / "train")["num_documents"] == 100
    assert ledger(tmp_path / "cache" / "validation")["num_documents"] == 10
    logged = metrics(tmp_path)
    assert [m["step"] for m in logged if "train/loss" in m] == [1, 2, 3] and "eval/loss" in logged[0]


def test_packed_data_with_a_model_that_takes_no_attention_mask_is_refused(tmp_path):
    from levanter_core.errors import ConfigError
    from levanter_core.run.initial import check_model_takes_packed_data

    class CausalOnly:
        def activations(self, input_ids, *, key=None):
            return input_ids

    data = {"train_urls": ["chat.jsonl"], "format": {"type": "chat"}, "cache_dir": str(tmp_path)}
    config, _ = load_train_config(run_config(tmp_path, data))
    with pytest.raises(ConfigError, match=r"cannot train on packed data \(data.format is 'chat'\).*takes no attn_mask"):
        check_model_takes_packed_data(CausalOnly(), config)
    text, _ = load_train_config(run_config(tmp_path, {**data, "format": {"type": "text"}}, run_id="text"))
    check_model_takes_packed_data(CausalOnly(), text)  # plain text needs no mask


@pytest.mark.slow
def test_a_mixture_tokenized_on_ray_trains_like_one_tokenized_locally(tmp_path, mixture_run):
    """Four caches built at once by Ray tasks (``trainer.ray.address: local`` starts a
    private Ray instance) hold what local worker processes build (those of ``mixture_run``),
    and train the same."""
    on_ray = run_config(
        tmp_path,
        {**mixture_data(mixture_run, MIXTURE_WEIGHTS), "cache_dir": str(tmp_path / "ray-cache")},
        run_id="ray",
        ray={"address": "local"},
    )

    result = run_cli("train", on_ray, "--no-progress")
    assert result.returncode == 0, result.stderr

    for name in ("code", "prose"):
        for split in ("train", "validation"):
            a, b = ledger(mixture_run / "cache" / name / split), ledger(tmp_path / "ray-cache" / name / split)
            assert a["complete"] and b["complete"]
            assert (a["num_documents"], a["num_tokens"]) == (b["num_documents"], b["num_tokens"])
    losses = [[m["train/loss"] for m in metrics(where, run) if "train/loss" in m]
              for where, run in ((mixture_run, "pipe"), (tmp_path, "ray"))]  # fmt: skip
    assert len(losses[0]) == 6 and losses[0] == losses[1]
