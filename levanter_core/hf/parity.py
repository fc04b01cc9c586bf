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
from typing import TYPE_CHECKING, Any, cast

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import Axis

from levanter_core.checkpoint import load_checkpoint, read_metadata, write_checkpoint
from levanter_core.config.base import validate_section
from levanter_core.hf.bridge import (
    SPECIAL_TOKENS,
    config_from_hf,
    export_hf,
    import_hf,
    in_vocabulary,
    load_hf_model,
    read_hf_config,
)
from levanter_core.inference.engine import Engine
from levanter_core.inference.sampling import SamplingParams
from levanter_core.models.source import load_model_source

if TYPE_CHECKING:
    from levanter_core.models.lm import LmConfig

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
    """The same for the ``config.json`` that ``export-hf`` wrote. A special token id that lies
    outside the vocabulary (a ``transformers`` family default such as GPT-2's 50256 in a tiny
    test model) is written as null on purpose, and not counted."""
    shards: int
    """Number of safetensors files the export wrote."""

    def assert_matches(self, tolerance: float = 1e-4, *, configs: bool = True, special_tokens: bool = True) -> None:
        """The test every family runs: logits within ``tolerance`` after import and after export,
        and (``configs``) the config unchanged by the round trip. ``special_tokens=False`` leaves
        the token ids out of the translated config's comparison (a translated config carries
        none: the exporter writes them, and the export's own comparison checks them)."""
        assert self.import_max_abs_diff <= tolerance, f"import: max abs diff {self.import_max_abs_diff}"
        assert self.export_max_abs_diff <= tolerance, f"export: max abs diff {self.export_max_abs_diff}"
        if configs:
            translated = {k: v for k, v in self.config_differences.items() if special_tokens or k not in SPECIAL_TOKENS}
            assert translated == {}, f"the config's round trip changes {translated}"
            assert self.export_config_differences == {}, f"the export changes {self.export_config_differences}"


def random_hf_model(hf_config, *, seed: int = 0, noise: float = 0.1, auto_class=None):
    """A ``transformers`` model of ``hf_config`` in eval mode, with every parameter (norm
    scales and biases included) perturbed by N(0, noise) so that no part of the model is an
    identity a bug could hide behind. ``auto_class``: the ``transformers`` auto class that
    builds it (default ``AutoModelForCausalLM``; ``AutoModelForSpeechSeq2Seq`` for Whisper)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    auto_class = auto_class or transformers.AutoModelForCausalLM
    model = auto_class.from_config(hf_config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise)
    return model.eval()


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


def our_logits(model, tokens: np.ndarray) -> np.ndarray:
    ids = hax.named(jnp.asarray(tokens, dtype=jnp.int32), ("batch", "position"))
    logits = eqx.filter_jit(lambda m, x: m(x))(model, ids)
    return np.asarray(logits.rearrange(("batch", "position", "vocab")).array)


def check_hf_parity(
    hf_config,
    workdir: str,
    *,
    seq_len: int = 24,
    batch: int = 2,
    max_shard_bytes: int = 64 * 1024,
    seed: int = 0,
    scan_layers: bool = True,
) -> ParityReport:
    """Run the whole import / compare / export / reload cycle for ``hf_config`` (a
    ``transformers`` config object) in ``workdir``; see the module docstring.

    With ``scan_layers=False`` the model is built with unrolled layers (``hnn.BlockSeq``):
    the weights are loaded as a run with ``initialize_from_hf`` and ``model.scan_layers:
    false`` loads them, saved as that run would save its checkpoint, and exported from it."""
    import transformers

    source, imported, exported = (os.path.join(workdir, d) for d in ("hf", "imported", "exported"))
    theirs = random_hf_model(hf_config, seed=seed)
    theirs.save_pretrained(source)
    tokens = np.random.default_rng(seed).integers(0, hf_config.vocab_size, size=(batch, seq_len))
    expected = hf_logits(theirs, tokens)

    config, Vocab, ours = import_as_checkpoint(source, imported, scan_layers=scan_layers)
    import_diff = float(np.max(np.abs(our_logits(ours, tokens) - expected)))

    export_hf(imported, exported, max_shard_bytes=max_shard_bytes)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported, attn_implementation="eager").eval()
    export_diff = float(np.max(np.abs(hf_logits(reloaded, tokens) - expected)))

    before = transformers.AutoConfig.from_pretrained(source).to_dict()
    translated = config.to_hf_config(Vocab.size)
    translated = transformers.AutoConfig.for_model(**translated).to_dict()
    exported_config = transformers.AutoConfig.from_pretrained(exported).to_dict()
    export_differences = {
        k: change
        for k, change in config_differences(before, exported_config).items()
        if not (k in SPECIAL_TOKENS and change[1] is None and not in_vocabulary(change[0], Vocab.size))
    }
    shards = len([f for f in os.listdir(exported) if f.endswith(".safetensors")])
    return ParityReport(import_diff, export_diff, config_differences(before, translated), export_differences, shards)


def import_as_checkpoint(source: str, imported: str, *, scan_layers: bool = True):
    """Our checkpoint at ``imported`` of the Hugging Face model directory ``source``, and its
    ``(config, Vocab, model)``: as ``levanter import-hf`` writes it, or with ``scan_layers``
    False, as a run with ``initialize_from_hf`` and ``model.scan_layers: false`` loads the
    weights (unrolled layers) and saves its checkpoint. A parity test exports from it."""
    if scan_layers:
        import_hf(source, imported)
        stored = read_metadata(imported)["metadata"]
        config = cast("LmConfig", validate_section("model", stored["config"]["model"]))
        Vocab = Axis("vocab", stored["vocab_size"])
        template = jax.eval_shape(lambda: config.build(Vocab, key=jax.random.PRNGKey(0)))
        return config, Vocab, load_checkpoint(template, imported, subtree="model")
    unrolled = config_from_hf(read_hf_config(source)).model_copy(update={"scan_layers": False})
    loaded = load_hf_model(source, config=unrolled)
    metadata = {
        "config": {"model": loaded.config.model_dump(mode="json")},
        "vocab_size": loaded.Vocab.size,
        "hf_config": loaded.hf_config,
    }
    write_checkpoint({"model": loaded.model}, imported, step=0, metadata=metadata)
    return loaded.config, loaded.Vocab, loaded.model


@dataclasses.dataclass
class GenerationReport:
    """Greedy continuations of the same prompts by ``transformers``' ``generate`` and by our engine."""

    prompts: list[list[int]]
    theirs: list[list[int]]
    ours: list[list[int]]

    def assert_matches(self) -> None:
        """Every continuation equal, token for token."""
        for prompt, theirs, ours in zip(self.prompts, self.theirs, self.ours):
            if theirs != ours:
                at = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
                raise AssertionError(
                    f"the continuations of a {len(prompt)}-token prompt differ from token {at} on: "
                    f"transformers {theirs[at : at + 8]}..., ours {ours[at : at + 8]}..."
                )


def check_generation_parity(
    hf_config,
    workdir: str,
    *,
    prompt_lengths: tuple[int, ...] = (3, 9, 14),
    new_tokens: int = 48,
    seed: int = 0,
) -> GenerationReport:
    """Greedy decoding of a tiny random ``transformers`` model of ``hf_config`` with its own
    ``generate`` (one prompt at a time, the end-of-sequence token ignored) and with our engine
    on its ``levanter import-hf`` import (all prompts in one batch, in slots of a key/value
    cache), ``new_tokens`` each."""
    import torch

    source, imported = os.path.join(workdir, "hf"), os.path.join(workdir, "imported")
    theirs_model = random_hf_model(hf_config, seed=seed)
    theirs_model.save_pretrained(source)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, hf_config.vocab_size, size=n).tolist() for n in prompt_lengths]
    generation = theirs_model.generation_config
    generation.update(eos_token_id=None, pad_token_id=0, max_new_tokens=new_tokens, do_sample=False)
    theirs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            # an explicit mask: one inferred from pad_token_id would hide the prompt's 0 tokens
            out = theirs_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=generation)
            theirs.append(out[0, len(prompt) :].tolist())

    import_hf(source, imported)
    loaded = load_model_source(imported)
    with Engine(loaded.model, max_seqs=len(prompts) + 1, max_rounds=4) as engine:
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        ours = [row[0].tokens for row in engine.generate(prompts, params)]
    return GenerationReport(prompts, theirs, ours)


def config_differences(before: dict, after: dict, ignored=frozenset()) -> dict[str, tuple[Any, Any]]:
    """The keys whose values differ between two ``transformers`` config dicts, as ``(before,
    after)``: neither the ``IGNORED_CONFIG_KEYS`` (bookkeeping, not the model) nor ``ignored``."""
    return {
        k: (before.get(k), after.get(k))
        for k in (before.keys() | after.keys()) - IGNORED_CONFIG_KEYS - set(ignored)
        if before.get(k) != after.get(k)
    }


def load_balancing_losses(hf_config, workdir: str, *, seed: int = 0, seq_len: int = 24, batch: int = 2):
    """``(ours, theirs, our_aux_loss)`` for a mixture-of-experts family: our unweighted
    ``moe/load_balancing_loss`` on a random ``transformers`` model of ``hf_config`` (imported from
    its checkpoint in ``workdir``), the ``aux_loss`` ``transformers`` computes on the same tokens,
    and our weighted auxiliary term (what training adds to the loss)."""
    import torch

    theirs = random_hf_model(hf_config, seed=seed)
    theirs.save_pretrained(workdir)
    tokens = np.random.default_rng(seed).integers(0, hf_config.vocab_size, size=(batch, seq_len))
    with torch.no_grad():
        out = theirs(torch.as_tensor(tokens), output_router_logits=True)
    ours = load_hf_model(workdir).model
    named = hax.named(jnp.asarray(tokens, dtype=jnp.int32), ("batch", "position"))
    _, aux = eqx.filter_jit(lambda m, x: m.activations_with_aux(x))(ours, named)
    return float(aux.metrics["moe/load_balancing_loss"]), float(out.aux_loss), float(aux.loss)
