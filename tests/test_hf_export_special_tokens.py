"""``export-hf`` writes the special token ids of the exported tokenizer into ``config.json``,
so that ``transformers`` neither falls back to its family's defaults (GPT-2's 50256, Gemma's
0/2/1) nor meets an id outside a small vocabulary."""

import json
import os

import jax
import numpy as np
import pytest
from haliax import Axis

from conftest import run_cli

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

from levanter_core.checkpoint import write_checkpoint  # noqa: E402
from levanter_core.hf.bridge import config_from_hf, import_hf  # noqa: E402
from levanter_core.hf.parity import hf_logits, our_logits, random_hf_model  # noqa: E402

BYTE_VOCAB = 257  # the byte tokenizer: 256 bytes and its end-of-text token, id 256


def run_checkpoint(path, config, *, tokenizer="byte", vocab_size=BYTE_VOCAB) -> tuple[str, object]:
    """A checkpoint as a training run with ``data.tokenizer: tokenizer`` leaves it (the model
    alone: export reads nothing else)."""
    model = config.build(Axis("vocab", vocab_size), key=jax.random.PRNGKey(0))
    metadata = {
        "config": {"model": config.model_dump(mode="json"), "data": {"tokenizer": tokenizer}},
        "vocab_size": vocab_size,
    }
    write_checkpoint({"model": model}, str(path), step=1, metadata=metadata)
    return str(path), model


def tiny(hf_config) -> object:
    return config_from_hf(hf_config.to_dict())


FAMILIES = {
    # transformers' defaults: bos = eos = 50256, outside a 257-token vocabulary
    "gpt2": lambda: tiny(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=32)),
    # pad 0, bos 2, eos 1: inside the vocabulary, but not the byte tokenizer's tokens
    "gemma": lambda: tiny(
        transformers.GemmaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=32,
        )
    ),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_export_writes_the_tokenizers_ids(family, tmp_path):
    checkpoint, model = run_checkpoint(tmp_path / "ckpt", FAMILIES[family]())
    exported = str(tmp_path / "exported")
    result = run_cli("export-hf", checkpoint, exported)
    assert result.returncode == 0, result.stderr

    with open(os.path.join(exported, "config.json")) as f:
        written = json.load(f)
    # the byte tokenizer defines an end-of-text token only; the others are null, not a default
    assert {k: written[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id")} == {
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": 256,
    }
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported, attn_implementation="eager").eval()
    assert reloaded.config.eos_token_id == 256 and reloaded.config.pad_token_id is None
    assert reloaded.generation_config.eos_token_id == 256
    tokens = np.random.default_rng(0).integers(0, BYTE_VOCAB, size=(1, 12))
    np.testing.assert_allclose(hf_logits(reloaded, tokens), our_logits(model, tokens), atol=1e-4)


def test_an_imported_pad_id_outside_the_vocabulary_is_not_exported(tmp_path):
    """A config.json whose pad id does not fit the vocabulary (a family default copied into a
    small model) makes transformers refuse the model; the export leaves it out."""
    from levanter_core.data.tokenizer import ByteTokenizer

    source = tmp_path / "hf"
    random_hf_model(
        transformers.LlamaConfig(
            vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=32,
        )
    ).save_pretrained(source)  # fmt: skip
    (source / "tokenizer.json").write_text(ByteTokenizer().to_tokenizer_json())
    hf_config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**hf_config, "pad_token_id": 32000, "bos_token_id": 1}))
    with pytest.raises(Exception, match="[Pp]adding_idx"):
        transformers.AutoModelForCausalLM.from_pretrained(source)

    imported, exported = import_hf(str(source), str(tmp_path / "imported")), str(tmp_path / "exported")
    assert run_cli("export-hf", imported, exported).returncode == 0
    written = json.loads(open(os.path.join(exported, "config.json")).read())
    # pad: out of the vocabulary, dropped; bos: the tokenizer has none, the original's is kept;
    # eos: the tokenizer's end-of-text token
    assert (written["pad_token_id"], written["bos_token_id"], written["eos_token_id"]) == (None, 1, 256)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert reloaded.config.pad_token_id is None


def test_a_tokenizer_with_named_special_tokens(tmp_path):
    """pad and bos come from the tokenizer_config.json beside the run's tokenizer.json."""
    from levanter_core.testing import train_bpe_tokenizer

    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    texts = ["def f(x):\n    return x + 1\n", "import os\nprint(os.getcwd())\n"] * 20
    train_bpe_tokenizer(
        texts, str(tokenizer_dir / "tokenizer.json"), vocab_size=300, special_tokens=("<pad>", "<s>", "</s>")
    )
    (tokenizer_dir / "tokenizer_config.json").write_text(
        json.dumps({"pad_token": "<pad>", "bos_token": {"content": "<s>"}, "eos_token": "</s>"})
    )
    from tokenizers import Tokenizer

    vocabulary = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    config = FAMILIES["gpt2"]()
    checkpoint, _ = run_checkpoint(
        tmp_path / "ckpt", config, tokenizer=str(tokenizer_dir), vocab_size=vocabulary.get_vocab_size()
    )
    exported = str(tmp_path / "exported")
    assert run_cli("export-hf", checkpoint, exported).returncode == 0
    reloaded = transformers.AutoConfig.from_pretrained(exported)
    assert (reloaded.pad_token_id, reloaded.bos_token_id, reloaded.eos_token_id) == tuple(
        vocabulary.token_to_id(t) for t in ("<pad>", "<s>", "</s>")
    )


# -- the chat template of a run trained on chat data --------------------------------------------

CUSTOM_TEMPLATE = (
    "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<<assistant>> {% endif %}"
)


@pytest.mark.parametrize("case", ["byte tokenizer, built-in template", "tokenizer directory, the format's template"])
def test_a_chat_run_exported_without_added_tokens_carries_its_template(case, tmp_path):
    """A run trained on chat data with no special tokens added: the export's tokenizer renders
    conversations in transformers as training rendered them (the snippet of docs/sft.md)."""
    from levanter_core.data.formats import render_chat_prompt
    from levanter_core.data.tokenizer import load_tokenizer
    from levanter_core.hf.bridge import export_hf
    from levanter_core.testing import train_bpe_tokenizer

    if case.startswith("byte"):
        tokenizer, vocab_size, template, fmt = "byte", BYTE_VOCAB, None, {"type": "chat"}
    else:
        directory = tmp_path / "tokenizer"
        directory.mkdir()
        train_bpe_tokenizer(["hello there, how are you"] * 20, str(directory / "tokenizer.json"), vocab_size=280,
                            special_tokens=("</s>",))  # fmt: skip
        # the tokenizer has a template of its own; the run chose another
        (directory / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
        tokenizer, vocab_size, template = str(directory), load_tokenizer(str(directory)).vocab_size, CUSTOM_TEMPLATE
        fmt = {"type": "chat", "chat_template": template}
    config = FAMILIES["gpt2"]()
    model = config.build(Axis("vocab", vocab_size), key=jax.random.PRNGKey(0))
    metadata = {
        "config": {"model": config.model_dump(mode="json"), "data": {"tokenizer": tokenizer, "format": fmt}},
        "vocab_size": vocab_size,
    }
    write_checkpoint({"model": model}, str(tmp_path / "ckpt"), step=1, metadata=metadata)
    exported = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "exported"))

    theirs = transformers.AutoTokenizer.from_pretrained(exported)
    messages = [{"role": "user", "content": "hi"}]
    rendered = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == render_chat_prompt(messages, load_tokenizer(tokenizer), template=template)
    ids = theirs.apply_chat_template(messages, add_generation_prompt=True)
    assert len(ids) > 0
