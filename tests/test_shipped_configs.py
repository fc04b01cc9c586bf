"""The realistic configs in ``config/`` that a GPU or TPU user starts from load as they are
and describe what their comments say; and every config the docs run exists. Structure only:
nothing is downloaded (the model is built as shapes, without memory)."""

import glob
import os
import re

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import pytest

from conftest import REPO
from levanter_core.config.train import load_train_config


def _load(name: str):
    return load_train_config(os.path.join(REPO, "config", f"{name}.yaml"))[0]


def _source(config):
    [source] = config.data.configs.values()
    return source


def _parameters(config, vocab_size: int) -> int:
    Vocab = hax.Axis("vocab", vocab_size)
    shapes = eqx.filter_eval_shape(lambda key: config.model.build(Vocab, key=key), jax.random.PRNGKey(0))
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(shapes) if hasattr(leaf, "shape"))


def test_gpt2_small_is_gpt2_124m_on_openwebtext():
    config = _load("gpt2_small")
    assert config.model.type == "gpt2" and config.model.seq_len == 1024
    assert _parameters(config, 50257) == 124_439_808  # GPT-2's 124M, with its 50257-token vocabulary
    source = _source(config)
    assert (source.type, source.id, config.data.tokenizer) == ("hf", "Skylion007/openwebtext", "gpt2")
    assert config.trainer.train_batch_size * config.model.seq_len * config.trainer.num_train_steps > 10e9
    assert config.trainer.mp == "p=f32,c=bfloat16" and config.trainer.require_accelerator


def test_llama_small_is_a_small_llama_on_a_web_corpus():
    config = _load("llama_small")
    assert config.model.type == "llama"
    assert _parameters(config, 32000) == 134_105_856
    source = _source(config)
    assert (source.type, source.id, source.name, source.stream) == ("hf", "allenai/c4", "en", True)
    assert config.data.tokenizer == "NousResearch/Llama-2-7b-hf"


def test_llama2_7b_continued_starts_from_the_hub_weights_and_their_architecture():
    config = _load("llama2_7b_continued")
    assert config.hf_source == "meta-llama/Llama-2-7b-hf" and config.use_hf_model_config
    assert config.model.type == "llama" and config.model.seq_len == 4096
    assert config.data.tokenizer == "meta-llama/Llama-2-7b-hf"
    assert config.trainer.initialize_from is None and config.trainer.require_accelerator
    assert config.optimizer.learning_rate < 6e-4  # continued pretraining: below a fresh run's peak


@pytest.mark.parametrize("name", ["gpt2_small", "llama_small", "llama2_7b_continued"])
def test_paths_are_local_so_the_config_loads_anywhere(name):
    config = _load(name)
    for path in [config.data.cache_dir, config.trainer.checkpointer.base_path, config.trainer.log_dir]:
        assert "://" not in path


DOCS = ["README.md", "docs/*.md", "plugins/*/README.md"]
"""The documents whose commands a new user copies."""

_FENCED = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1", re.S | re.M)
# A path into this repository: one of its top-level folders, not inside a longer path or URL
# (``levanter/config/harness/x.yaml``, a clone of Levanter's repository, is not one)
_REPO_PATH = re.compile(r"(?<![\w/.$~-])((?:config|docs|plugins|tests|bench|examples|levanter_core)/[\w./-]*\w)")
# `levanter train NAME` (or cache) with a name that is not a file: a config a plugin ships
_CONFIG_NAME = re.compile(r"\blevanter (?:train|cache) +([a-z][\w.:-]*)(?=[\s`]|$)")


def _documents() -> dict[str, str]:
    found = sorted({path for pattern in DOCS for path in glob.glob(os.path.join(REPO, pattern))})
    return {os.path.relpath(path, REPO): open(path).read() for path in found}


def _exists(path: str, doc: str) -> bool:
    """Whether ``path`` (as a document writes it) names something in the repository: from its
    root, from the document's folder, or (a file tree drawn in the document) at the end of a
    longer path."""
    if os.path.exists(os.path.join(REPO, path)) or os.path.exists(os.path.join(REPO, os.path.dirname(doc), path)):
        return True
    return bool(glob.glob(os.path.join(REPO, "**", path), recursive=True))


def test_every_path_and_config_name_in_the_docs_code_exists():
    """What README.md, docs/*.md and the plugins' READMEs show in code blocks (the commands a new
    user copies) names files and folders of this repository that exist, and `levanter train
    NAME` names a config an installed plugin ships (also in inline code)."""
    from levanter_core.plugins.configs import packaged_configs

    shipped = {c.name for c in packaged_configs()} | {c.qualified for c in packaged_configs()}
    missing, named = [], set()
    for doc, text in _documents().items():
        blocks = [m.group(2) for m in _FENCED.finditer(text)]
        for block in blocks:
            for path in _REPO_PATH.findall(block):
                named.add((os.path.basename(doc), path))
                if "..." not in path and not _exists(path, doc):
                    missing.append(f"{doc}: {path}")
        commands = blocks + re.findall(r"`([^`\n]+)`", _FENCED.sub("", text))
        for command in commands:
            for name in _CONFIG_NAME.findall(command):
                if not name.endswith((".yaml", ".yml")) and name not in shipped:
                    missing.append(f"{doc}: levanter train {name} (no plugin ships a config of that name)")
    assert not missing, missing
    assert ("gpu-cluster.md", "config/gpt2_small.yaml") in named and ("tpu-pod.md", "config/gpt2_small.yaml") in named
