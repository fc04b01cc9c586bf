"""Whisper against Hugging Face's ``WhisperForConditionalGeneration``: import and export (stacked
and unrolled layers, tiny and whisper-tiny shapes), the CLI round trip, Levanter's field names,
incremental decoding, the refusals, and discovery. (Levanter's Whisper config: test_levanter_config.py.)"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from levanter_core.errors import CheckpointError, ConfigError, UserError
from levanter_core.hf.parity import config_differences, import_as_checkpoint, random_hf_model
from levanter_core.testing.model_family import DiscoveryTests

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

# Encoder and decoder differ in heads and feed-forward widths, so that mixing them up fails;
# the special tokens lie inside the tiny vocabulary (transformers' defaults, 50256..., do not).
TINY = dict(
    vocab_size=96,
    num_mel_bins=8,
    d_model=32,
    encoder_layers=2,
    encoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_layers=2,
    decoder_attention_heads=2,
    decoder_ffn_dim=48,
    max_source_positions=16,
    max_target_positions=24,
    pad_token_id=95,
    bos_token_id=95,
    eos_token_id=95,
    decoder_start_token_id=94,
    begin_suppress_tokens=[95],
)

WHISPER_TINY = dict(  # the shapes of openai/whisper-tiny's config.json
    vocab_size=51865,
    num_mel_bins=80,
    d_model=384,
    encoder_layers=4,
    encoder_attention_heads=6,
    encoder_ffn_dim=1536,
    decoder_layers=4,
    decoder_attention_heads=6,
    decoder_ffn_dim=1536,
    max_source_positions=1500,
    max_target_positions=448,
)

# config.json keys that are generation's, not the model's
GENERATION = {"pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "begin_suppress_tokens"}


def random_whisper(hf_config, *, seed: int = 0):
    """A random ``transformers`` Whisper of ``hf_config``, every parameter (the fixed encoder
    positions included) perturbed (:func:`levanter_core.hf.parity.random_hf_model`)."""
    return random_hf_model(hf_config, seed=seed, auto_class=transformers.AutoModelForSpeechSeq2Seq)


def inputs(hf_config, *, batch: int = 2, tokens: int = 12, seed: int = 0):
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((batch, hf_config.num_mel_bins, 2 * hf_config.max_source_positions))
    ids = rng.integers(0, hf_config.vocab_size, size=(batch, tokens))
    return features.astype(np.float32), ids


def hf_logits(model, features, ids) -> np.ndarray:
    with torch.no_grad():
        out = model(input_features=torch.as_tensor(features), decoder_input_ids=torch.as_tensor(ids))
    return out.logits.float().numpy()


def named_inputs(features, ids):
    import haliax as hax
    import jax.numpy as jnp

    return (
        hax.named(jnp.asarray(features), ("batch", "mels", "frames")),
        hax.named(jnp.asarray(ids, dtype=jnp.int32), ("batch", "position")),
    )


def our_logits(model, features, ids) -> np.ndarray:
    import equinox as eqx

    logits = eqx.filter_jit(lambda m, f, t: m(f, t))(model, *named_inputs(features, ids))
    return np.asarray(logits.rearrange(("batch", "position", "vocab")).array)


def hf_source(hf_config, directory: Path) -> dict:
    """A random ``transformers`` Whisper of ``hf_config`` saved in ``directory``, inputs, and its logits."""
    theirs = random_whisper(hf_config)
    theirs.save_pretrained(directory)
    features, ids = inputs(hf_config)
    return {"dir": str(directory), "features": features, "ids": ids, "expected": hf_logits(theirs, features, ids)}


def check_parity(
    hf_config, workdir: Path, *, scan_layers: bool = True, max_shard_bytes: int = 64 * 1024, hf: dict | None = None
) -> dict:
    """Import a random ``transformers`` Whisper (``hf``, from :func:`hf_source`, or a new one) as
    ``levanter import-hf`` does (or, unrolled, as a run with ``scan_layers: false`` loads and saves
    it), compare logits; export it, reload the export in ``transformers`` and compare again;
    translate the config to ours and back."""
    from levanter_core.hf.bridge import export_hf

    hf = hf or hf_source(hf_config, workdir / "hf")
    source, features, ids, expected = hf["dir"], hf["features"], hf["ids"], hf["expected"]
    imported, exported = (str(workdir / d) for d in ("imported", "exported"))

    config, Vocab, ours = import_as_checkpoint(source, imported, scan_layers=scan_layers)
    import_diff = float(np.max(np.abs(our_logits(ours, features, ids) - expected)))

    export_hf(imported, exported, max_shard_bytes=max_shard_bytes)
    reloaded = transformers.WhisperForConditionalGeneration.from_pretrained(
        exported, attn_implementation="eager"
    ).eval()
    export_diff = float(np.max(np.abs(hf_logits(reloaded, features, ids) - expected)))

    before = transformers.WhisperConfig.from_pretrained(source).to_dict()
    translated = transformers.WhisperConfig(**config.to_hf_config(Vocab.size)).to_dict()
    after_export = transformers.WhisperConfig.from_pretrained(exported).to_dict()
    return {
        "import": import_diff,
        "export": export_diff,
        "translated": config_differences(before, translated, ignored=GENERATION),
        "exported": config_differences(before, after_export),
        "shards": len([f for f in os.listdir(exported) if f.endswith(".safetensors")]),
        "config": config,
    }


# transformers computes an embedding scale from scale_embedding but never applies it: a file
# with it set gives the same logits, and the key, which we do not translate, survives the export
VARIANTS = {"gelu": {}, "relu": {"activation_function": "relu"}, "scale_embedding": {"scale_embedding": True}}
UNTRANSLATED = {"scale_embedding"}


@pytest.mark.parametrize("scan_layers", [True, False], ids=["stacked", "unrolled"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_whisper_matches_transformers_both_ways(variant, scan_layers, tmp_path):
    report = check_parity(transformers.WhisperConfig(**TINY, **VARIANTS[variant]), tmp_path, scan_layers=scan_layers)
    print(f"tiny {variant} scan_layers={scan_layers}: import {report['import']:.2e}, export {report['export']:.2e}")
    assert report["import"] <= 1e-4, report["import"]
    assert report["export"] <= 1e-4, report["export"]
    assert {k: v for k, v in report["translated"].items() if k not in UNTRANSLATED} == {}
    assert report["exported"] == {}
    assert report["shards"] > 1
    assert report["config"].scan_layers is scan_layers


@pytest.fixture(scope="module")
def whisper_tiny_source(tmp_path_factory):
    """A random Whisper of openai/whisper-tiny's shapes and its logits, made once (39M parameters to
    draw, save and run in ``transformers``) for both layer layouts."""
    return hf_source(transformers.WhisperConfig(**WHISPER_TINY), tmp_path_factory.mktemp("whisper-tiny") / "hf")


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [True, False], ids=["stacked", "unrolled"])
def test_whisper_tiny_shapes_match_transformers_both_ways(scan_layers, tmp_path, whisper_tiny_source):
    """openai/whisper-tiny's shapes (random weights: nothing is downloaded), 30 s of frames."""
    hf_config = transformers.WhisperConfig(**WHISPER_TINY)
    report = check_parity(hf_config, tmp_path, scan_layers=scan_layers, max_shard_bytes=2**26, hf=whisper_tiny_source)
    print(
        f"whisper-tiny shapes scan_layers={scan_layers}: import {report['import']:.2e}, export {report['export']:.2e}"
    )
    assert report["import"] <= 1e-4 and report["export"] <= 1e-4
    assert report["translated"] == {} and report["exported"] == {}
    # our defaults are whisper-tiny's
    defaults = report["config"].model_validate({"type": "whisper", "scan_layers": scan_layers})
    assert report["config"] == defaults


def test_import_and_export_through_the_cli(tmp_path, capsys):
    from levanter_core.cli import main

    hf_config = transformers.WhisperConfig(**TINY)
    theirs = random_whisper(hf_config, seed=3)
    theirs.save_pretrained(tmp_path / "hf")
    for args in (["import-hf", str(tmp_path / "hf"), str(tmp_path / "ours")],
                 ["export-hf", str(tmp_path / "ours"), str(tmp_path / "back")]):  # fmt: skip
        with pytest.raises(SystemExit) as exited:
            main(args)
        assert exited.value.code == 0, capsys.readouterr().err
    with open(tmp_path / "back" / "config.json") as f:
        written = json.load(f)
    assert written["architectures"] == ["WhisperForConditionalGeneration"] and written["model_type"] == "whisper"
    assert written["decoder_start_token_id"] == 94  # kept from the imported config.json
    back = transformers.WhisperForConditionalGeneration.from_pretrained(tmp_path / "back").eval()
    features, ids = inputs(hf_config, seed=5)
    np.testing.assert_allclose(hf_logits(back, features, ids), hf_logits(theirs, features, ids), atol=1e-4, rtol=0)


def test_a_base_model_checkpoint_loads(tmp_path):
    """``WhisperModel`` (no head) saves its tensors without the ``model.`` prefix; it loads as the
    whole model, whose head is the token embeddings anyway."""
    from levanter_core.hf.bridge import load_hf_model

    hf_config = transformers.WhisperConfig(**TINY)
    theirs = random_whisper(hf_config, seed=7)
    theirs.model.save_pretrained(tmp_path / "base")
    loaded = load_hf_model(str(tmp_path / "base"))
    features, ids = inputs(hf_config, seed=7)
    np.testing.assert_allclose(
        our_logits(loaded.model, features, ids), hf_logits(theirs, features, ids), atol=1e-4, rtol=0
    )


def _tiny_model(**overrides):
    import jax
    from haliax import Axis

    from levanter_model_whisper.whisper import WhisperConfig

    fields = dict(
        d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, decoder_layers=3,
        decoder_attention_heads=2, decoder_ffn_dim=48, num_mel_bins=8, max_source_positions=16, seq_len=24,
    )  # fmt: skip
    config = WhisperConfig(**{**fields, **overrides})
    return config.build(Axis("vocab", 40), key=jax.random.PRNGKey(0))


@pytest.mark.parametrize("scan_layers", [True, False], ids=["stacked", "unrolled"])
def test_decoding_token_by_token_gives_the_logits_of_the_whole_transcript(scan_layers):
    """The incremental path (cross-attention keys computed once, a key/value cache for the
    decoder) computes what ``decode`` does over the whole sequence."""
    import equinox as eqx
    import haliax as hax
    import jax.numpy as jnp
    from haliax import Axis

    model = _tiny_model(scan_layers=scan_layers)
    features, ids = inputs(transformers.WhisperConfig(**TINY), tokens=7, seed=1)
    features, tokens = named_inputs(features, ids % 40)
    states = eqx.filter_jit(lambda m, f: m.encode(f))(model, features)
    whole = eqx.filter_jit(lambda m, t, s: m.decode(t, s))(model, tokens, states)
    whole = whole.rearrange(("batch", "position", "vocab")).array

    cache = eqx.filter_jit(lambda m, s: m.init_decoder_cache(s, Axis("key_position", 24)))(model, states)
    # one compiled step for all: it reads the whole cache, whose later positions the causal
    # mask must hide (they hold nothing yet)
    step = eqx.filter_jit(lambda m, tok, pos, c: m.decode_step(tok, pos, c, key_len=24))
    steps = []
    for t in range(7):
        token = tokens["position", t : t + 1]
        positions = hax.named(jnp.full((2, 1), t, dtype=jnp.int32), ("batch", "position"))
        hidden, cache = step(model, token, positions, cache)
        logits = hax.dot(hidden, model.get_lm_head(), axis="embed")
        steps.append(logits.rearrange(("batch", "position", "vocab")).array)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), whole, atol=1e-5, rtol=0)


def test_attention_backends_agree():
    """``jax`` (cuDNN's fused kernel on GPU, what ``auto`` picks there) computes what ``reference`` does."""
    features, ids = inputs(transformers.WhisperConfig(**TINY), seed=2)
    ids = ids % 40
    reference = our_logits(_tiny_model(attn_backend="reference"), features, ids)
    fused = our_logits(_tiny_model(attn_backend="jax"), features, ids)
    np.testing.assert_allclose(fused, reference, atol=1e-5, rtol=0)


def _loss_and_grads(model, features, ids):
    """A loss (the mean log-probability of token 3) and its gradients, one compiled program."""
    import equinox as eqx
    import haliax as hax

    def loss(m):
        logits = m(features, ids)
        return -hax.mean(hax.nn.log_softmax(logits, axis="vocab")["vocab", 3]).scalar()

    return eqx.filter_jit(eqx.filter_value_and_grad(loss))(model)


@pytest.fixture(scope="module")
def auto_gradients():
    """The tiny model (``auto`` attention: row by row on the CPU), its inputs, and a loss's value
    and gradients: computed once for the two tests below."""
    features, ids = named_inputs(*inputs(transformers.WhisperConfig(**TINY), seed=5))
    ids = ids % 40
    model = _tiny_model()
    return model, features, ids, _loss_and_grads(model, features, ids)


def test_cpu_attention_by_rows_gives_the_reference_gradients(auto_gradients):
    """On the CPU, ``auto`` runs the unmasked attention (encoder, cross-attention) row by row with
    its own backward pass; a loss's gradients agree with ``reference``'s, parameter for parameter."""
    import jax

    assert jax.default_backend() == "cpu"
    _, features, ids, by_rows = auto_gradients
    reference = _loss_and_grads(_tiny_model(attn_backend="reference"), features, ids)
    by_rows, reference = jax.tree.leaves(by_rows), jax.tree.leaves(reference)
    assert len(by_rows) == len(reference)
    for ours, theirs in zip(by_rows, reference):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=1e-6, rtol=1e-4)


def test_gradients_reach_every_parameter_but_the_fixed_encoder_positions(auto_gradients):
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    model, features, _, (_, grads) = auto_gradients
    encoder = grads.model.encoder
    assert float(jnp.abs(encoder.embed_positions.weight.array).max()) == 0.0
    for name, g in [("conv1", encoder.conv1.weight), ("decoder positions", grads.model.decoder.embed_positions.weight),
                    ("cross-attention keys", grads.model.decoder.layers.stacked.encoder_attn.k_proj.weight)]:  # fmt: skip
        assert float(jnp.abs(g.array).max()) > 0.0, name
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, model)
    # float32 features into bfloat16 weights; the output's type is known from tracing (nothing to compile)
    assert eqx.filter_eval_shape(lambda m, f: m.encode(f), half, features).dtype == jnp.bfloat16


def test_flops_per_token_counts_what_xla_counts():
    """A third of ``flops_per_token`` is the forward pass per transcript token: XLA's count of the
    (unrolled) forward is that plus the elementwise work (norms, softmax, GELU). XLA counts the
    lowered program (its cost analysis of the HLO; compiling it changes the count by under 1%)."""
    import haliax as hax
    import jax
    import jax.numpy as jnp
    from haliax import Axis

    model = _tiny_model(d_model=64, encoder_ffn_dim=256, max_source_positions=64, seq_len=32, scan_layers=False)
    c = model.config
    features = hax.zeros((Axis("batch", 1), c.Mels, c.Frames))
    tokens = hax.named(jnp.zeros((1, c.seq_len), dtype=jnp.int32), ("batch", "position"))
    lowered = jax.jit(lambda m, f, t: m(f, t)).lower(model, features, tokens)
    xla = lowered.cost_analysis()["flops"] / c.seq_len
    ours = c.flops_per_token(model.Vocab.size) / 3
    assert 0.8 * xla <= ours <= xla, (ours, xla)


def test_a_row_inserted_into_a_cache_decodes_as_on_its_own():
    """A transcription started in one row of a shared cache (as a batching engine would) goes on
    as it does in a cache of its own, whatever the other rows hold."""
    import equinox as eqx
    import haliax as hax
    import jax.numpy as jnp
    from haliax import Axis

    features, ids = named_inputs(*inputs(transformers.WhisperConfig(**TINY), batch=2, tokens=4, seed=6))
    KeyPos = Axis("key_position", 8)

    def run(model, cache, tokens, start):
        n = tokens.resolve_axis("position").size
        rows = tokens.resolve_axis("batch").size
        positions = hax.named(jnp.broadcast_to(jnp.arange(start, start + n), (rows, n)), ("batch", "position"))
        hidden, cache = model.decode_step(tokens, positions, cache, key_len=start + n)
        return hax.dot(hidden, model.get_lm_head(), axis="embed").array, cache

    @eqx.filter_jit  # the whole scenario is one program (run op by op, each op is compiled on its own)
    def scenario(model, features, ids):
        second_audio = features["batch", 1:2]
        alone, _ = run(model, model.init_decoder_cache(model.encode(second_audio), KeyPos), ids["batch", 1:2], 0)

        shared = model.init_decoder_cache(model.encode(features), KeyPos)
        _, shared = run(model, shared, ids, 0)  # both rows hold a transcription of their own
        fresh = model.init_decoder_cache(model.encode(second_audio), KeyPos)
        _, fresh = run(model, fresh, ids["batch", 1:2, "position", :2], 0)
        shared = shared.insert(jnp.array([0]), fresh)  # row 0 now starts over with the second audio
        rest = ids.array[1, 2:]
        logits, _ = run(model, shared, hax.named(jnp.stack([rest, rest]), ("batch", "position")), 2)
        return logits[0], alone[0, 2:]

    row, alone = scenario(_tiny_model(), features, ids % 40)
    np.testing.assert_allclose(row, alone, atol=1e-5, rtol=0)


def test_encoder_takes_shorter_spectrograms_and_refuses_longer_ones():
    import haliax as hax
    import jax
    from haliax import Axis

    model = _tiny_model()
    short = hax.random.normal(jax.random.PRNGKey(0), (Axis("batch", 1), Axis("mels", 8), Axis("frames", 20)))
    assert model.encode(short).resolve_axis("source_position").size == 10
    long = hax.random.normal(jax.random.PRNGKey(0), (Axis("batch", 1), Axis("mels", 8), Axis("frames", 34)))
    with pytest.raises(ValueError, match=r"34 frames; the encoder takes at most 32"):
        model.encode(long)


def test_the_text_only_language_model_interface_refuses_by_name():
    """The next-token trainer and evaluation reach these, and the generation engine serves a text
    prompt alone (``levanter sample``); each says why not."""
    import haliax as hax
    import jax.numpy as jnp
    from haliax import Axis

    from levanter_core.inference.engine import Engine
    from levanter_core.inference.sampling import SamplingParams

    model = _tiny_model()
    ids = hax.named(jnp.zeros((1, 4), dtype=jnp.int32), ("batch", "position"))
    with pytest.raises(ConfigError, match=r"model.type 'whisper' is a speech-recognition encoder-decoder"):
        model.activations(ids)
    with pytest.raises(UserError, match=r"cannot be trained, evaluated or sampled as a next-token language model"):
        model.init_cache(Axis("batch", 1), Axis("key_position", 8))
    with pytest.raises(
        UserError, match=r"model type 'whisper' is an encoder-decoder: each request needs an encoder input"
    ):
        Engine(model, max_seqs=2).submit([1, 2], SamplingParams(max_new_tokens=2))
    with pytest.raises(ConfigError, match=r"model.vocab_size is 32, but the vocabulary has 40 tokens"):
        _tiny_model(vocab_size=32)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [None, "text"])
def test_levanter_train_on_text_stops_with_a_message_not_a_traceback(tmp_path, fmt, capfd):
    """`levanter train` with `model: {type: whisper}` and text data stops with exit status 2 and
    a message, no traceback: read as audio (the format Whisper's sources default to), the first
    record has no audio, named by file and line; declared as text, the asr objective refuses it.
    The command runs in this process (a subprocess would cost its imports again): an unexpected
    exception would escape ``main`` instead of its exit, and ``capfd`` reads all it wrote to the
    standard error, whether through ``sys.stderr`` or the file descriptor."""
    import yaml

    from levanter_core.cli import main

    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"text": f"line {i} " * 20}) + "\n" for i in range(40)))
    data = {"tokenizer": "byte", "train_urls": [str(tmp_path / "data.jsonl")], "cache_dir": str(tmp_path / "cache")}
    config = {
        "data": {**data, **({"format": {"type": fmt}} if fmt else {})},
        "model": {"type": "whisper", "d_model": 32, "encoder_layers": 1, "decoder_layers": 1,
                  "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 32,
                  "decoder_ffn_dim": 32, "num_mel_bins": 8, "max_source_positions": 8, "max_length": 32},
        "trainer": {"id": "w", "train_batch_size": 2, "num_train_steps": 2, "log_dir": str(tmp_path / "logs"),
                    "checkpointer": {"base_path": str(tmp_path / "ckpt")}, "require_accelerator": False},
    }  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    capfd.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["train", str(tmp_path / "run.yaml")])
    stderr = capfd.readouterr().err
    assert exited.value.code == 2, stderr[-3000:]
    assert "Traceback" not in stderr
    if fmt is None:
        assert "data.jsonl:1: no 'audio' field (the audio); the record has 'text'" in stderr
    else:
        assert "model.type 'whisper' trains with the asr objective, which reads audio" in stderr


def test_unsupported_settings_are_refused_by_name():
    from levanter_core.hf.bridge import config_from_hf

    base = transformers.WhisperConfig(**TINY).to_dict()
    for key, value, message in [
        ("dropout", 0.1, "dropout: 0.1 is not supported"),
        ("apply_spec_augment", True, "apply_spec_augment: true is not supported"),
        ("architectures", ["WhisperForAudioClassification"], "architectures ['WhisperForAudioClassification']"),
    ]:
        with pytest.raises(CheckpointError, match=re.escape(message)):
            config_from_hf({**base, key: value})
    config = config_from_hf(base)
    with pytest.raises(ValueError, match="layer_norm_epsilon 0.001 has no Hugging Face Whisper equivalent"):
        config.model_copy(update={"layer_norm_epsilon": 1e-3}).to_hf_config(96)


def test_levanter_field_names_are_accepted():
    from levanter_core.config.base import validate_section

    config = validate_section("model", {"type": "whisper", "max_length": 128, "num_mels": 128, "hidden_dim": 768})
    assert (config.seq_len, config.num_mel_bins, config.d_model) == (128, 128, 768)
    with pytest.raises(Exception, match="d_model \\(384\\) must be divisible by decoder_attention_heads \\(5\\)"):
        validate_section("model", {"type": "whisper", "decoder_attention_heads": 5})
    with pytest.raises(Exception, match="d_model \\(385\\) must be even"):
        validate_section("model", {"type": "whisper", "d_model": 385, "encoder_attention_heads": 5})


class TestWhisperDiscovery(DiscoveryTests):
    distribution = "levanter-model-whisper"
    types = {"model": ["whisper"], "objective": ["asr"]}
    hooks = frozenset({"register_models", "model_type_for_hf_config", "register_objectives", "register_commands"})
