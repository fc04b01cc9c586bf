"""Checking an architecture plugin against ``transformers``: the test every model plugin runs.

:func:`check_hf_parity` builds a tiny random model with ``transformers`` (PyTorch, CPU,
float32, eager attention), saves it, imports it with ``levanter import-hf``'s code,
compares our logits with theirs on the same tokens, exports ours with ``export-hf``'s
code, reloads that in ``transformers`` and compares again, and checks that the
configuration survives the round trip. Needs ``torch`` and ``transformers`` (test-only
dependencies); nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

# config.json keys that describe the file or the runtime rather than the model
IGNORED_CONFIG_KEYS = frozenset(
    {"architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path", "output_router_logits"}
)


@dataclasses.dataclass
class ParityReport:
    import_max_abs_diff: float
    """Largest |our logit - theirs| after import."""
    export_max_abs_diff: float
    """Largest |reloaded export's logit - original's|."""
    config_differences: dict[str, tuple[Any, Any]]
    """Config keys whose values change when the Hugging Face config is translated to ours
    and back (``from_hf_config`` then ``to_hf_config``, nothing else kept): key -> (before, after)."""
    export_config_differences: dict[str, tuple[Any, Any]]
    """The same for the ``config.json`` that ``export-hf`` wrote."""
    shards: int
    """Number of safetensors files the export wrote."""


def random_hf_model(hf_config, *, seed: int = 0, noise: float = 0.1):
    """A ``transformers`` causal LM of ``hf_config`` in eval mode, with every parameter
    (norm scales and biases included) perturbed by N(0, noise) so that no part of the
    model is an identity a bug could hide behind."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise)
    return model.eval()


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


def our_logits(model, tokens: np.ndarray) -> np.ndarray:
    import equinox as eqx
    import haliax as hax
    import jax.numpy as jnp

    ids = hax.named(jnp.asarray(tokens, dtype=jnp.int32), ("batch", "position"))
    logits = eqx.filter_jit(lambda m, x: m(x))(model, ids)
    return np.asarray(logits.rearrange(("batch", "position", "vocab")).array)


def check_hf_parity(
    hf_config, workdir: str, *, seq_len: int = 24, batch: int = 2, max_shard_bytes: int = 64 * 1024, seed: int = 0
) -> ParityReport:
    """Run the whole import / compare / export / reload cycle for ``hf_config`` (a
    ``transformers`` config object) in ``workdir``; see the module docstring."""
    import jax
    import transformers
    from haliax import Axis

    from levanter_core.checkpoint import load_checkpoint, read_metadata
    from levanter_core.config.base import validate_section
    from levanter_core.hf.bridge import export_hf, import_hf

    source, imported, exported = (os.path.join(workdir, d) for d in ("hf", "imported", "exported"))
    theirs = random_hf_model(hf_config, seed=seed)
    theirs.save_pretrained(source)
    tokens = np.random.default_rng(seed).integers(0, hf_config.vocab_size, size=(batch, seq_len))
    expected = hf_logits(theirs, tokens)

    import_hf(source, imported)
    stored = read_metadata(imported)["metadata"]
    config = validate_section("model", stored["config"]["model"])
    Vocab = Axis("vocab", stored["vocab_size"])
    template = jax.eval_shape(lambda: config.build(Vocab, key=jax.random.PRNGKey(0)))
    ours = load_checkpoint(template, imported, subtree="model")
    import_diff = float(np.max(np.abs(our_logits(ours, tokens) - expected)))

    export_hf(imported, exported, max_shard_bytes=max_shard_bytes)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported, attn_implementation="eager").eval()
    export_diff = float(np.max(np.abs(hf_logits(reloaded, tokens) - expected)))

    before = transformers.AutoConfig.from_pretrained(source).to_dict()
    translated = config.to_hf_config(Vocab.size)
    translated = transformers.AutoConfig.for_model(**translated).to_dict()
    exported_config = transformers.AutoConfig.from_pretrained(exported).to_dict()
    shards = len([f for f in os.listdir(exported) if f.endswith(".safetensors")])
    return ParityReport(
        import_diff, export_diff, _differences(before, translated), _differences(before, exported_config), shards
    )


def _differences(before: dict, after: dict) -> dict[str, tuple[Any, Any]]:
    return {
        k: (before.get(k), after.get(k))
        for k in (before.keys() | after.keys()) - IGNORED_CONFIG_KEYS
        if before.get(k) != after.get(k)
    }
