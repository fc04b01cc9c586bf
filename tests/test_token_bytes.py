"""Bytes per token, the denominator of bits per byte: every token's bytes add up to the text's."""

import json

import numpy as np
import pytest

from levanter_core.data.token_bytes import token_byte_lengths
from levanter_core.data.tokenizer import ByteTokenizer, HfTokenizer
from levanter_core.testing import train_bpe_tokenizer

TEXTS = [
    "def f(x):\n    return x + 1\n",
    "Ça coûte 5 € — naïve café, 日本語のテキスト, emoji 🙂.",
    "the quick brown fox jumps over the lazy dog " * 3,
]


def byte_count(tokenizer, text: str) -> int:
    (ids,) = tokenizer.encode_batch([text])
    return int(token_byte_lengths(tokenizer)[ids].sum())


def test_the_byte_tokenizer():
    tok = ByteTokenizer()
    lengths = token_byte_lengths(tok)
    assert lengths.shape == (257,) and lengths[256] == 0 and (lengths[:256] == 1).all()
    for text in TEXTS:
        assert byte_count(tok, text) == len(text.encode("utf-8"))


def test_a_byte_level_bpe(tmp_path):
    path = train_bpe_tokenizer(TEXTS * 5, str(tmp_path / "tokenizer.json"), vocab_size=400)
    tok = HfTokenizer("bpe", open(path).read())
    for text in TEXTS + ["unseen words: zebra, Ωmega\t\ttabs"]:
        assert byte_count(tok, text) == len(text.encode("utf-8"))
    # the end-of-text token covers no text
    assert token_byte_lengths(tok)[tok.eos_id] == 0
    (ids,) = tok.encode_batch(["a<|endoftext|>b"])
    assert token_byte_lengths(tok)[ids].sum() == 2


def sentencepiece_style() -> HfTokenizer:
    """A tiny vocabulary in Llama 2's manner: ``▁`` marks a space, unknown bytes fall back to
    ``<0xNN>`` tokens, ``</s>`` is special and ``<extra>`` an ordinary added token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "▁": 2, "▁the": 3, "▁cat": 4, "s": 5, "a": 6, "t": 7, "c": 8}
    vocab |= {f"<0x{b:02X}>": 9 + b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    tok.add_tokens([AddedToken("<extra>", special=False)])
    return HfTokenizer("sp", tok.to_str(), eos_token="</s>")


def test_a_sentencepiece_style_vocabulary():
    tok = sentencepiece_style()
    lengths = token_byte_lengths(tok)
    vocab = json.loads(tok.to_tokenizer_json())["model"]["vocab"]
    assert lengths[vocab["▁the"]] == 4 and lengths[vocab["<0xC3>"]] == 1 and lengths[tok.eos_id] == 0
    # "▁the▁cats": the prefix space is the one byte more than the text has
    assert byte_count(tok, "the cats") == len(b" the cats")
    # é is not in the vocabulary: two fallback bytes
    (ids,) = tok.encode_batch(["the café"])
    assert lengths[ids].sum() == len(" the café".encode())
    # the tokenizer prepends "▁" to the text after an added token too: it decodes as a space
    (ids,) = tok.encode_batch(["the<extra>cat</s>"])
    assert tok.decode(ids) == " the<extra> cat</s>"
    assert lengths[ids].sum() == len(b" the<extra> cat")


@pytest.mark.parametrize("text", TEXTS)
def test_bits_per_byte_by_hand(text):
    """Loss in nats over a text's tokens, turned into bits per byte, equals the same loss
    spread over the text's bytes by hand."""
    tok = ByteTokenizer()
    (ids,) = tok.encode_batch([text])
    nats = np.full(len(ids), 0.5)  # a model that gives every byte probability e^-0.5
    bpb = nats.sum() / np.log(2) / token_byte_lengths(tok)[ids].sum()
    assert bpb == pytest.approx(0.5 / np.log(2))
