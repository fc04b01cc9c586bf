"""A tiny model and three local lm-eval tasks to evaluate it on, with nothing downloaded: a
random ``transformers`` Llama with a byte-level BPE trained here, and tasks whose YAML and
JSON-lines data sit in one include directory.

* ``tiny_mc``: multiple choice (accuracy), some questions with one-token answers, some with
  answers of several words;
* ``tiny_gen``: generation until a stop string (exact match);
* ``tiny_ppl``: rolling log-likelihood of whole texts, some longer than the context given to
  the harness (word and byte perplexity, bits per byte);
* ``tiny_group``: a group of ``tiny_mc`` and ``tiny_ppl``.
"""

from __future__ import annotations

import json
import os

CONTEXT = 256
"""The tiny model's context (``max_position_embeddings``)."""

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, how are you today?",
    "language models predict the next token from the ones before it",
    "a harness asks a model many questions and counts the right answers",
    "question: what is the capital of france? answer: paris",
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

MC_DOCS = [
    {"question": "the quick brown fox jumps over the", "choices": [" dog", " cat", " fox"], "answer": 0},
    {"question": "hello world, how are", "choices": [" you", " we", " they"], "answer": 0},
    {"question": "what is the capital of france?", "choices": [" paris", " rome", " london", " berlin"], "answer": 0},
    {
        "question": "a harness asks a model",
        "choices": [" many questions and counts", " the lazy dog today", " nothing at all"],
        "answer": 0,
    },
    {"question": "language models predict", "choices": [" the next token", " the weather", " colors"], "answer": 0},
    {"question": "the lazy dog", "choices": [" jumps", " sleeps"], "answer": 1},
    {"question": "how are you", "choices": [" today?", " tomorrow?", " now?"], "answer": 0},
    {"question": "", "choices": [" hello world", " goodbye world"], "answer": 0},
    # longer than the context the tests give the harness (64 tokens): cut from the left
    {
        "question": "hello world! " * 20 + "the quick brown fox jumps over the",
        "choices": [" lazy dog", " cat"],
        "answer": 0,
    },
]

GEN_DOCS = [
    {"prompt": "the quick brown fox", "target": " jumps over the lazy dog"},
    {"prompt": "hello world,", "target": " how are you today?"},
    {"prompt": "question: what is the capital of france? answer:", "target": " paris"},
    {"prompt": "language models predict the next token", "target": " from the ones before it"},
    {"prompt": "a harness asks a model many", "target": " questions"},
]

PPL_DOCS = [
    {"text": "the quick brown fox jumps over the lazy dog."},
    {"text": " ".join(SENTENCES)},
    {"text": "hello world! " * 30},
    {"text": "a"},
]

MC_YAML = """\
task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    train: {train}
    test: {test}
training_split: train
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""

GEN_YAML = """\
task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {test}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["?", "\\n\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""

PPL_YAML = """\
task: tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {test}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


GROUP_YAML = """\
group: tiny_group
task: [tiny_mc, tiny_ppl]
aggregate_metric_list:
  - metric: acc
    weight_by_size: true
"""


def make_tiny_model(directory: str) -> str:
    """A random two-layer Llama and its tokenizer (``tokenizer.json`` with a
    ``tokenizer_config.json`` naming its end-of-text token and giving a chat template), as a
    Hugging Face model directory."""
    from levanter_core.testing import tiny_hf_llama

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "bos_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    return tiny_hf_llama(directory, SENTENCES * 4, vocab_size=300, context=CONTEXT, tokenizer_config=tokenizer_config)


def cache_hub_dataset(cache_dir: str, repo_id: str, config_name: str, split: str, docs: list[dict]) -> None:
    """Put ``docs`` where ``datasets`` finds the hub dataset ``repo_id`` (its configuration
    ``config_name``, split ``split``) when it cannot reach the hub: a prepared copy in the
    datasets cache ``cache_dir``, laid out as a first, online ``load_dataset`` leaves it."""
    import glob
    import shutil
    import tempfile

    import datasets

    with tempfile.TemporaryDirectory() as scratch:
        source = _jsonl(os.path.join(scratch, f"{split}.jsonl"), docs)
        datasets.load_dataset("json", data_files={split: source}, cache_dir=scratch)
        (prepared,) = [p for p in glob.glob(os.path.join(scratch, "json", "*", "*", "*")) if os.path.isdir(p)]
        namespace, name = repo_id.split("/")
        target = os.path.join(cache_dir, f"{namespace}___{name}", config_name, "0.0.0", os.path.basename(prepared))
        shutil.copytree(prepared, target)
    for file in os.listdir(target):  # the arrow files are named after the dataset
        if file.startswith("json-"):
            os.rename(os.path.join(target, file), os.path.join(target, f"{name}-{file[len('json-') :]}"))


def _jsonl(path: str, docs: list[dict]) -> str:
    with open(path, "w") as f:
        for doc in docs:
            f.write(json.dumps(doc) + "\n")
    return path


def make_tasks(directory: str) -> str:
    """The three tasks' YAML and data in ``directory`` (an lm-eval include path)."""
    os.makedirs(directory, exist_ok=True)
    data = os.path.join(directory, "data")
    os.makedirs(data, exist_ok=True)
    mc_train = _jsonl(os.path.join(data, "mc_train.jsonl"), MC_DOCS[:3])
    mc_test = _jsonl(os.path.join(data, "mc_test.jsonl"), MC_DOCS)
    gen = _jsonl(os.path.join(data, "gen.jsonl"), GEN_DOCS)
    ppl = _jsonl(os.path.join(data, "ppl.jsonl"), PPL_DOCS)
    for name, text in [
        ("tiny_mc.yaml", MC_YAML.format(train=mc_train, test=mc_test)),
        ("tiny_gen.yaml", GEN_YAML.format(test=gen)),
        ("tiny_ppl.yaml", PPL_YAML.format(test=ppl)),
        ("tiny_group.yaml", GROUP_YAML),
    ]:
        with open(os.path.join(directory, name), "w") as f:
            f.write(text)
    return directory
