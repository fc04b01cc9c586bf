"""Preference pairs through the core's cache, and tiny Hugging Face Llamas to score them with:
nothing is downloaded."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from levanter_core.data.cache import open_cache
from levanter_core.data.dataset import Batch, sequence_dataset
from levanter_core.data.source import UrlSourceConfig
from levanter_core.data.tokenizer import ByteTokenizer
from levanter_core.testing import write_jsonl

LLAMA = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, bos_token_id=256, eos_token_id=256)  # fmt: skip
"""A two-layer Llama whose vocabulary holds the byte tokenizer's 257 tokens."""

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What does a cat sit on?"}]

PAIRS = [
    {"prompt": "Q: 2+2=", "chosen": "4", "rejected": "5"},
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " made of green cheese."},
    {"chosen": CHAT + [{"role": "assistant", "content": "A mat."}],
     "rejected": CHAT + [{"role": "assistant", "content": "The moon, mostly."}]},
    {"prompt": CHAT, "chosen": "A mat.", "rejected": [{"role": "assistant", "content": "Nothing"}]},
]  # fmt: skip
"""Pairs in every form the format reads: text with a prompt, conversations with their prompt
inside, a conversation prompt with a text and a message answer."""


def preference_batch(tmp_path, records, seq_len: int, fmt: dict | None = None) -> Batch:
    """``records`` written as JSON lines, cached with the ``preference`` format and the byte
    tokenizer, read back as one batch of the core's ``document`` layout (rows cut or padded to
    ``seq_len``, as a run of the dpo objective reads them)."""
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    source = UrlSourceConfig(train_urls=[path], format={"type": "preference", **(fmt or {})})
    return cached_rows(tmp_path, source, seq_len)


def cached_rows(tmp_path, source, seq_len: int) -> Batch:
    """Every pair of ``source``'s training split, cached with the byte tokenizer, as one batch
    of rows of ``seq_len``."""
    from levanter_preference.objective import DpoObjective

    cache = open_cache(str(tmp_path / "cache"), source, "train", ByteTokenizer(), enforce_eos=True,
                       skip_bad_data=False, background=False)  # fmt: skip
    lengths = DpoObjective.row_lengths(SimpleNamespace(seq_len=seq_len))
    dataset = sequence_dataset(cache, seq_len, layout="document", field_lengths=lengths)
    return dataset.rows(np.arange(cache.num_documents))


@pytest.fixture(scope="session")
def llamas(tmp_path_factory) -> tuple[str, str]:
    """Two random Hugging Face Llamas of one architecture (seeds 0 and 1), saved: a policy and
    a reference."""
    import transformers

    from levanter_core.hf.parity import random_hf_model

    dirs = []
    for seed in (0, 1):
        directory = str(tmp_path_factory.mktemp(f"llama-{seed}"))
        random_hf_model(transformers.LlamaConfig(**LLAMA), seed=seed).save_pretrained(directory)
        dirs.append(directory)
    return dirs[0], dirs[1]
