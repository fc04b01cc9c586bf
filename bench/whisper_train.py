"""Whisper training throughput (issue 21): the core's ``Trainer`` with the ``asr`` objective beside
``transformers``' ``WhisperForConditionalGeneration`` in torch, same model, same batch, same run.

Both sides train the same architecture (``--preset``: whisper-tiny's shapes by default) from
random weights on the same batch: utterances that eSpeak NG speaks on this machine
(``levanter_audio.synth``), each padded with silence to the encoder's window (30 s for
whisper-tiny), and transcripts of random token ids as long as the sentences' (the decoder reads
``seq_len`` positions on both sides; the loss counts the transcript's).

* **ours**: ``validate_train_config`` -> ``configure_jax`` -> ``Trainer`` with
  ``SpeechRecognition`` and the optimizer section's AdamW, as ``levanter train`` builds them;
  one step is ``trainer.train_step(state, SpeechBatch)``: the samples go to the device, the
  log-mel features are computed there, then forward, backward and the update, in one compiled
  program.
* **transformers**: ``WhisperFeatureExtractor`` on the batch's raw utterances (its input
  pipeline, timed as part of the step and reported on its own), then forward with labels,
  backward, ``torch.optim.AdamW.step()``; ``torch.set_num_threads`` = the cores this process
  may use.

After warm-up steps (compilation; torch's allocator), ``--rounds`` rounds each time
``--steps`` steps of ours, then of theirs (A B A B), so that both see the same machine. Figures:
step time, audio seconds per second (rows x seconds of speech in each row / step time) and
window seconds per second (rows x the window's seconds, as both pad to it), and the ratio of
ours to theirs, with their feature extraction counted in their step and without it.

``--profile`` also times the same pieces of both steps, each run on its own (ours jitted piece
by piece): the features; the encoder forward, and forward and backward; the decoder and the
loss given the encoder's states; the loss alone given the decoder's hidden states; the whole
model; the whole step; and by difference the decoder without the loss and the optimizer.

    .venv/bin/python bench/whisper_train.py [--preset tiny|small|test] [--batch N] [--rounds 3]
                                            [--steps 2] [--warmup 2] [--layers scan|unrolled|blockseq]
                                            [--mp p=f32] [--device auto|cpu|gpu] [--torch-threads N]
                                            [--profile] [--out FILE.json]

On a machine that other work keeps busy, torch's threads wait on each other (OpenMP) and its
step slows several times more than ours: compare runs whose load average stays below the cores,
or give ``--torch-threads 1`` (faster for torch on a loaded 2-core machine).

On a GPU (``--device auto`` finds it; ``gpu`` insists): JAX on the GPU, torch on CUDA, the
feature extractor on CUDA; ``--mp p=f32,c=bfloat16`` runs ours in bf16 compute and theirs under
``torch.autocast(bfloat16)``; ``--batch 64`` keeps a GPU busier than the CPU's 8 rows.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time

import numpy as np
from levanter_audio.features import HOP_LENGTH, SAMPLE_RATE

SENTENCES = (
    "the quick brown fox jumps over the lazy dog",
    "she sells sea shells by the sea shore every summer",
    "a small model learns to hear what people say",
    "please call stella and ask her to bring these things",
    "the birch canoe slid on the smooth planks",
    "glue the sheet to the dark blue background",
    "it is easy to tell the depth of a well",
    "these days a chicken leg is a rare dish",
)
"""Distinct utterances, 1.8 to 2.8 s each as eSpeak speaks them (they fit the small preset's 4 s
window), repeated over the batch's rows."""

TOKENS_PER_CHARACTER = 0.25  # about what Whisper's byte-level BPE gives English text

PRESETS: dict[str, dict] = {
    # openai/whisper-tiny's shapes: 30 s windows (3,000 frames, 1,500 source positions).
    "tiny": {
        "model": {"d_model": 384, "encoder_layers": 4, "decoder_layers": 4, "encoder_attention_heads": 6,
                  "decoder_attention_heads": 6, "encoder_ffn_dim": 1536, "decoder_ffn_dim": 1536,
                  "num_mel_bins": 80, "max_source_positions": 1500, "seq_len": 64},
        "vocab_size": 51865,
        "batch": 8,
        "layers": "unrolled",
    },
    # A quicker run: a 4 s window (400 frames, 200 source positions), d_model 256.
    "small": {
        "model": {"d_model": 256, "encoder_layers": 4, "decoder_layers": 4, "encoder_attention_heads": 4,
                  "decoder_attention_heads": 4, "encoder_ffn_dim": 1024, "decoder_ffn_dim": 1024,
                  "num_mel_bins": 80, "max_source_positions": 200, "seq_len": 64},
        "vocab_size": 51865,
        "batch": 8,
        "layers": "scan",
    },
    # Not a benchmark: exercises this script in seconds (tests use it). A 1 s window.
    "test": {
        "model": {"d_model": 32, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2,
                  "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
                  "num_mel_bins": 80, "max_source_positions": 50, "seq_len": 16},
        "vocab_size": 300,
        "batch": 2,
        "layers": "scan",
    },
}  # fmt: skip
"""Model shapes (our ``model:`` section's names), vocabulary, batch, and how our layers run
(``LAYER_CHOICES``: the faster on 2 CPU cores, measured alternately in one process, 2026-11-26:
whisper-tiny's 8 rows 8.27 s unrolled against 8.66 s scanned; the small preset 0.85 s scanned
against 0.92 s unrolled)."""

LAYER_CHOICES = {
    "scan": {"scan_layers": True, "unroll_layers": False},
    "unrolled": {"scan_layers": True, "unroll_layers": True},
    "blockseq": {"scan_layers": False, "unroll_layers": False},
}
"""How our layers run: one ``lax.scan`` per stack; the stacked layers unrolled into straight-line
code; or a ``BlockSeq`` of separate layers (``scan_layers: false``)."""

LEARNING_RATE = 1e-4
WEIGHT_DECAY = 0.1


# -- the batch -------------------------------------------------------------------------------


def make_batch(preset: dict, seed: int = 0) -> dict:
    """The batch both sides train on: ``utterances`` (each row's samples, cut to the window),
    ``audio`` ``[rows, window samples]`` (the same, padded with zeros), ``tokens`` ``[rows,
    seq_len]`` int32 (random ids), ``loss_mask`` (1 where the next token is the transcript's) and
    ``labels`` (transformers': each position's next token, -100 where not scored)."""
    from levanter_audio.synth import synthesize

    rows, vocab, seq_len = preset["batch"], preset["vocab_size"], preset["model"]["seq_len"]
    window = 2 * preset["model"]["max_source_positions"] * HOP_LENGTH
    spoken = {s: synthesize(s) for s in SENTENCES[: min(rows, len(SENTENCES))]}
    sentences = [SENTENCES[i % len(spoken)] for i in range(rows)]
    utterances = [np.asarray(spoken[s][:window], np.float32) for s in sentences]
    audio = np.zeros((rows, window), np.float32)
    for row, samples in enumerate(utterances):
        audio[row, : len(samples)] = samples

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(rows, seq_len)).astype(np.int32)
    loss_mask = np.zeros((rows, seq_len), np.float32)
    for row, sentence in enumerate(sentences):
        # start tokens (3), the words, end of text
        length = min(seq_len, 4 + round(len(sentence) * TOKENS_PER_CHARACTER))
        loss_mask[row, : length - 1] = 1
    labels = np.where(loss_mask > 0, np.roll(tokens, -1, axis=1), -100).astype(np.int64)
    return {"utterances": utterances, "audio": audio, "tokens": tokens, "loss_mask": loss_mask, "labels": labels,
            "sentences": sentences, "window_samples": window}  # fmt: skip


# -- ours ----------------------------------------------------------------------------------------


def our_config(preset: dict, layers: str, mp: str, workdir: str, steps: int, *, checkpointing: bool = False):
    """The run's config, validated as ``levanter train`` validates a YAML file."""
    from levanter_core.config.loader import Sources
    from levanter_core.config.train import validate_train_config

    raw = {
        "data": {"tokenizer": "byte", "train_urls": ["unused.jsonl"]},
        "model": {"type": "whisper", **preset["model"], "gradient_checkpointing": checkpointing,
                  **LAYER_CHOICES[layers]},
        "trainer": {"mp": mp, "train_batch_size": preset["batch"], "num_train_steps": steps,
                    "log_dir": os.path.join(workdir, "logs"),
                    "checkpointer": {"base_path": os.path.join(workdir, "checkpoints")}},
        "optimizer": {"type": "adam", "learning_rate": LEARNING_RATE, "weight_decay": WEIGHT_DECAY},
    }  # fmt: skip
    return validate_train_config(raw, Sources("bench"))


class Ours:
    """The core's trainer on the batch: :meth:`step` runs one training step and waits for it."""

    def __init__(
        self, preset: dict, batch: dict, *, layers: str, mp: str, workdir: str, steps: int, checkpointing: bool = False
    ):
        import jax
        from haliax import Axis
        from levanter_model_whisper.objective import SpeechBatch, SpeechRecognition

        from levanter_core.run import configure_jax
        from levanter_core.trainer.mesh import make_mesh
        from levanter_core.trainer.trainer import Trainer

        self.config = config = our_config(preset, layers, mp, workdir, steps, checkpointing=checkpointing)
        configure_jax(config)
        self.Vocab = Vocab = Axis("vocab", preset["vocab_size"])
        self.objective = SpeechRecognition.from_config(config)
        self.trainer = Trainer(
            config.trainer, config.optimizer.build_for_trainer(steps), self.objective, mesh=make_mesh(config.trainer)
        )
        self.state = self.trainer.init_state(lambda key: config.model.build(Vocab, key=key), jax.random.PRNGKey(0))
        self.batch = SpeechBatch(batch["audio"], batch["tokens"], batch["loss_mask"])
        self.parameters = sum(x.size for x in jax.tree.leaves(self.state.model) if hasattr(x, "size"))
        self.losses: list[float] = []

    def step(self) -> float:
        import jax

        started = time.perf_counter()
        self.state, metrics = self.trainer.train_step(self.state, self.batch)
        jax.block_until_ready((self.state, metrics))
        took = time.perf_counter() - started
        self.losses.append(float(metrics["train/loss"]))
        return took


def profile_ours(ours: Ours, repeats: int) -> dict:
    """Median seconds of pieces of our step, each compiled on its own, on the same batch and
    weights (compute precision as the step's): the features; the encoder forward, and forward and
    backward; the decoder and the loss, forward and backward, given the encoder's states; the loss
    alone, forward and backward, given the decoder's hidden states; the whole model forward, and
    forward and backward; then the whole step. Differences give the decoder without the loss, and
    the optimizer's update with the rest of the step. A stand-in loss (the sum of the states'
    squares) ends the encoder's backward pass: its cost does not depend on what comes after."""
    import equinox as eqx
    import haliax as hax
    import jax
    from levanter_model_whisper.objective import features_of

    from levanter_core.models.lm import next_token_loss

    trainer, objective = ours.trainer, ours.objective
    example = trainer.to_device(ours.batch, trainer.Batch)
    key = jax.random.PRNGKey(1)
    model = trainer.mp.cast_to_compute(ours.state.model)
    with hax.partitioning.set_mesh(trainer.mesh), hax.axis_mapping(trainer.compute_mapping):
        states = eqx.filter_jit(lambda m, ex: m.encode(features_of(m, ex.audio)))(model, example)
        hidden = eqx.filter_jit(lambda m, ex, s: m.decoder_activations(ex.tokens, s))(model, example, states)

    def encoder_loss(m, ex):
        return hax.sum(m.encode(features_of(m, ex.audio)).astype("float32") ** 2).scalar()

    def decoder_loss(m, ex, s):
        return next_token_loss(m, ex.tokens, ex.loss_mask, hidden=m.decoder_activations(ex.tokens, s))

    def loss_alone(m, ex, h):
        return next_token_loss(m, ex.tokens, ex.loss_mask, hidden=h)

    def whole(m, ex):
        return objective.loss(m, ex, key=key)[0]

    pieces = {
        "features": (lambda m, ex: features_of(m, ex.audio).array, (model, example)),
        "encoder forward": (lambda m, ex: m.encode(features_of(m, ex.audio)).array, (model, example)),
        "encoder forward + backward": (eqx.filter_grad(encoder_loss), (model, example)),
        "decoder + loss forward + backward": (eqx.filter_grad(decoder_loss), (model, example, states)),
        # with respect to the hidden states and the model (the head's gradient; the rest is zeros)
        "loss forward + backward": (
            eqx.filter_grad(lambda hidden_model, ex: loss_alone(hidden_model[1], ex, hidden_model[0])),
            ((hidden, model), example),
        ),
        "whole model forward + loss": (whole, (model, example)),
        "whole model forward + backward": (eqx.filter_value_and_grad(whole), (model, example)),
    }
    out = {}
    with hax.partitioning.set_mesh(trainer.mesh), hax.axis_mapping(trainer.compute_mapping):
        for name, (fn, args) in pieces.items():
            compiled = eqx.filter_jit(fn)
            out[name] = median_seconds(
                lambda compiled=compiled, args=args: jax.block_until_ready(compiled(*args)), repeats
            )
    out["whole step"] = statistics.median([ours.step() for _ in range(repeats)])
    return with_differences(out)


def median_seconds(call, repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``call`` (which waits for its work), after one
    untimed call."""
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def with_differences(pieces: dict) -> dict:
    """``pieces`` with the two that are known only by difference."""
    decoder = pieces["decoder + loss forward + backward"] - pieces["loss forward + backward"]
    rest = pieces["whole step"] - pieces["whole model forward + backward"]
    return {**pieces, "decoder without the loss (difference)": decoder,
            "optimizer and the rest (whole step - forward + backward)": rest}  # fmt: skip


# -- theirs --------------------------------------------------------------------------------------


def hf_config(preset: dict):
    """``transformers``' ``WhisperConfig`` of the preset's model: the same shapes, no dropout,
    no SpecAugment (ours has neither)."""
    import transformers

    m = preset["model"]
    return transformers.WhisperConfig(
        vocab_size=preset["vocab_size"], num_mel_bins=m["num_mel_bins"], d_model=m["d_model"],
        encoder_layers=m["encoder_layers"], encoder_attention_heads=m["encoder_attention_heads"],
        encoder_ffn_dim=m["encoder_ffn_dim"], decoder_layers=m["decoder_layers"],
        decoder_attention_heads=m["decoder_attention_heads"], decoder_ffn_dim=m["decoder_ffn_dim"],
        max_source_positions=m["max_source_positions"], max_target_positions=m["seq_len"],
        pad_token_id=0, bos_token_id=0, eos_token_id=0, decoder_start_token_id=0,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, apply_spec_augment=False,
    )  # fmt: skip


class Theirs:
    """``transformers``' Whisper in torch on the batch: :meth:`step` returns (seconds of the whole
    step, seconds of its feature extraction)."""

    def __init__(self, preset: dict, batch: dict, *, device: str, bf16: bool):
        import torch
        import transformers

        self.torch, self.device, self.bf16 = torch, device, bf16
        torch.manual_seed(0)
        self.model = transformers.WhisperForConditionalGeneration(hf_config(preset)).to(device).train()
        self.attention = self.model.config._attn_implementation
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
        window_seconds = batch["window_samples"] // SAMPLE_RATE
        self.extractor = transformers.WhisperFeatureExtractor(
            feature_size=preset["model"]["num_mel_bins"], chunk_length=window_seconds
        )
        self.utterances = batch["utterances"]
        self.tokens = torch.as_tensor(batch["tokens"], dtype=torch.long, device=device)
        self.labels = torch.as_tensor(batch["labels"], device=device)
        self.parameters = sum(p.numel() for p in self.model.parameters())
        self.losses: list[float] = []

    def _sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def step(self) -> tuple[float, float]:
        torch = self.torch
        started = time.perf_counter()
        features = self.extractor(
            self.utterances, sampling_rate=SAMPLE_RATE, return_tensors="pt", device=self.device
        ).input_features.to(self.device)
        self._sync()
        extracted = time.perf_counter()
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.bf16):
            out = self.model(input_features=features, decoder_input_ids=self.tokens, labels=self.labels)
        out.loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._sync()
        done = time.perf_counter()
        self.losses.append(out.loss.item())
        return done - started, extracted - started


def profile_theirs(theirs: Theirs, repeats: int) -> dict:
    """The pieces of :func:`profile_ours`, timed the same way on ``transformers``' side: the
    feature extractor; the encoder forward (no gradients kept), and forward and backward; the
    decoder and the loss (``labels``), forward and backward, given the encoder's states; the loss
    alone (output projection and cross-entropy) given the decoder's hidden states; the whole
    model, forward, and forward and backward; then the whole step without the features."""
    torch = theirs.torch
    model, device = theirs.model, theirs.device
    features = theirs.extractor(theirs.utterances, sampling_rate=SAMPLE_RATE, return_tensors="pt", device=device)
    features = features.input_features.to(device)

    def autocast():
        return torch.autocast(device, dtype=torch.bfloat16, enabled=theirs.bf16)

    with torch.no_grad(), autocast():
        states = model.model.encoder(features).last_hidden_state
        hidden = model.model.decoder(input_ids=theirs.tokens, encoder_hidden_states=states).last_hidden_state

    def backward(loss):
        loss.backward()
        model.zero_grad(set_to_none=True)

    def encoder_forward():
        with torch.no_grad(), autocast():
            model.model.encoder(features)

    def encoder_backward():
        with autocast():
            out = model.model.encoder(features).last_hidden_state
        backward((out.float() ** 2).sum())

    def decoder_backward():
        with autocast():
            out = model(encoder_outputs=(states,), decoder_input_ids=theirs.tokens, labels=theirs.labels)
        backward(out.loss)

    def loss_backward():
        h = hidden.detach().requires_grad_()
        with autocast():
            logits = model.proj_out(h)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), theirs.labels.flatten())
        backward(loss)

    def whole_forward():
        with autocast():
            model(input_features=features, decoder_input_ids=theirs.tokens, labels=theirs.labels)

    def whole_backward():
        with autocast():
            out = model(input_features=features, decoder_input_ids=theirs.tokens, labels=theirs.labels)
        backward(out.loss)

    def whole_step():
        with autocast():
            out = model(input_features=features, decoder_input_ids=theirs.tokens, labels=theirs.labels)
        out.loss.backward()
        theirs.optimizer.step()
        theirs.optimizer.zero_grad(set_to_none=True)

    def extract():
        theirs.extractor(theirs.utterances, sampling_rate=SAMPLE_RATE, return_tensors="pt", device=device)

    pieces = {"features": extract, "encoder forward": encoder_forward, "encoder forward + backward": encoder_backward,
              "decoder + loss forward + backward": decoder_backward, "loss forward + backward": loss_backward,
              "whole model forward + loss": whole_forward, "whole model forward + backward": whole_backward,
              "whole step": whole_step}  # fmt: skip

    def waited(fn):
        def call():
            fn()
            theirs._sync()

        return call

    theirs._sync()
    return with_differences({name: median_seconds(waited(fn), repeats) for name, fn in pieces.items()})


# -- the run -------------------------------------------------------------------------------------


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}


def machine_info(torch_device: str) -> dict:
    import jax
    import torch
    import transformers
    from reference_gpt2 import cpu_name

    info = {
        "nproc": os.cpu_count(),
        "cores_available": len(os.sched_getaffinity(0)),
        "cpu": cpu_name(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "torch": torch.__version__,
        "torch_device": torch_device,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
    }
    if torch_device == "cuda":
        info["cuda_device"] = torch.cuda.get_device_name()
    return info


def benchmark(preset_name: str, *, batch_size: int | None = None, rounds: int, steps: int, warmup: int,
              layers: str | None, mp: str, device: str, torch_threads: int | None = None, profile: bool = False,
              workdir: str | None = None) -> dict:  # fmt: skip
    """Both sides on ``PRESETS[preset_name]``: every figure, as JSON-able data."""
    import jax
    import torch

    preset = PRESETS[preset_name] if batch_size is None else {**PRESETS[preset_name], "batch": batch_size}
    layers = layers or preset["layers"]
    torch.set_num_threads(torch_threads or len(os.sched_getaffinity(0)))
    if device == "gpu" and not (torch.cuda.is_available() and jax.default_backend() == "gpu"):
        raise SystemExit(
            f"--device gpu: torch sees CUDA: {torch.cuda.is_available()}; JAX's backend is {jax.default_backend()}"
        )
    torch_device = "cuda" if device != "cpu" and torch.cuda.is_available() else "cpu"
    bf16 = "bfloat16" in mp or "bf16" in mp

    load_before = os.getloadavg()
    batch = make_batch(preset)
    workdir = workdir or tempfile.mkdtemp(prefix="whisper-train-")
    started = time.perf_counter()
    ours = Ours(preset, batch, layers=layers, mp=mp, workdir=workdir, steps=warmup + rounds * steps + 10)
    first = ours.step()  # compiles
    warm_ours = [ours.step() for _ in range(warmup - 1)]
    ours_ready = time.perf_counter() - started
    theirs = Theirs(preset, batch, device=torch_device, bf16=bf16)
    warm_theirs = [theirs.step() for _ in range(warmup)]

    timed_ours: list[list[float]] = []
    timed_theirs: list[list[tuple[float, float]]] = []
    for r in range(rounds):  # A B A B
        timed_ours.append([ours.step() for _ in range(steps)])
        timed_theirs.append([theirs.step() for _ in range(steps)])
        print(f"round {r + 1}/{rounds}: ours " + ", ".join(f"{t:.3f}" for t in timed_ours[-1])
              + " s; transformers " + ", ".join(f"{t:.3f} (features {f:.3f})" for t, f in timed_theirs[-1]) + " s",
              flush=True)  # fmt: skip
    pieces = None
    if profile:
        pieces = {"transformers": profile_theirs(theirs, max(2, steps))}
        del theirs.model, theirs.optimizer  # their memory back before ours is compiled piece by piece
        gc.collect()
        pieces["ours"] = profile_ours(ours, max(2, steps))
    load_after = os.getloadavg()

    rows = preset["batch"]
    audio_seconds = sum(len(u) for u in batch["utterances"]) / SAMPLE_RATE
    window_seconds = rows * batch["window_samples"] / SAMPLE_RATE
    ours_times = [t for r in timed_ours for t in r]
    theirs_times = [t for r in timed_theirs for t, _ in r]
    theirs_features = [f for r in timed_theirs for _, f in r]
    theirs_model = [t - f for r in timed_theirs for t, f in r]
    o, t, tm = statistics.median(ours_times), statistics.median(theirs_times), statistics.median(theirs_model)

    def side(step_time):
        return {"audio_seconds_per_second": audio_seconds / step_time,
                "window_seconds_per_second": window_seconds / step_time}  # fmt: skip

    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
        "machine": machine_info(torch_device),
        "load_average_1_5_15min": {"before": load_before, "after": load_after},
        "preset": preset_name,
        "model": {
            **preset["model"],
            "vocab_size": preset["vocab_size"],
            "layers": layers,
            **LAYER_CHOICES[layers],
            "gradient_checkpointing": False,
        },
        "parameters": {"ours": int(ours.parameters), "transformers": int(theirs.parameters)},
        "mp": mp,
        "transformers_attention": theirs.attention,
        "transformers_autocast_bf16": bf16,
        "batch": {
            "rows": rows,
            "seq_len": preset["model"]["seq_len"],
            "window_seconds_per_row": batch["window_samples"] / SAMPLE_RATE,
            "audio_seconds": audio_seconds,
            "window_seconds": window_seconds,
            "transcript_tokens": int(batch["loss_mask"].sum()) + rows,
        },
        "rounds": rounds,
        "steps_per_round": steps,
        "warmup_steps": warmup,
        "ours": {
            "first_step_seconds": first,
            "warmup_step_seconds": warm_ours,
            "seconds_to_ready": ours_ready,
            "step_seconds": summarize(ours_times),
            "per_round_median": [statistics.median(r) for r in timed_ours],
            **side(o),
            "loss_first_last": [ours.losses[0], ours.losses[-1]],
        },
        "transformers": {
            "warmup_step_seconds": [s for s, _ in warm_theirs],
            "step_seconds": summarize(theirs_times),
            "features_seconds": summarize(theirs_features),
            "step_without_features_seconds": summarize(theirs_model),
            "per_round_median": [statistics.median(s for s, _ in r) for r in timed_theirs],
            **side(t),
            "without_features": side(tm),
            "loss_first_last": [theirs.losses[0], theirs.losses[-1]],
        },
        "ratio": {
            "vs_step_with_features": t / o,
            "vs_step_without_features": tm / o,
            "per_round_with_features": [
                statistics.median(s for s, _ in b) / statistics.median(a) for a, b in zip(timed_ours, timed_theirs)
            ],
        },
        "goal_ratio": 1.5,
        "profile_seconds": pieces,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def print_table(r: dict) -> None:
    m, b, o, t = r["machine"], r["batch"], r["ours"], r["transformers"]
    model = r["model"]
    rows = [
        ("machine", f"{m['cores_available']} cores, {m['cpu']}; jax {m['jax']} ({m['jax_backend']}), "
                    f"torch {m['torch']} ({m['torch_device']}, {m['torch_threads']} threads), transformers {m['transformers']}"),
        ("load average (1 min) before/after", "{:.2f} / {:.2f}".format(
            r["load_average_1_5_15min"]["before"][0], r["load_average_1_5_15min"]["after"][0])),
        ("model", f"{r['preset']}: d_model {model['d_model']}, {model['encoder_layers']}+{model['decoder_layers']} layers, "
                  f"{model['max_source_positions']} source positions, vocab {model['vocab_size']:,}; "
                  f"{r['parameters']['ours'] / 1e6:.2f} M parameters (transformers {r['parameters']['transformers'] / 1e6:.2f} M)"),
        ("ours", f"layers {model['layers']}, mp {r['mp']}, no gradient checkpointing"),
        ("transformers", f"attention {r['transformers_attention']}, autocast bf16 {r['transformers_autocast_bf16']}"),
        ("batch", f"{b['rows']} rows x {b['window_seconds_per_row']:.0f} s windows ({b['window_seconds']:.0f} s), "
                  f"{b['audio_seconds']:.1f} s of speech, seq_len {b['seq_len']}"),
        ("timed steps", f"{r['rounds']} rounds x {r['steps_per_round']} steps each side, alternating"),
        ("ours: first step (compiles)", f"{o['first_step_seconds']:.1f} s"),
        ("ours: step time", "{median:.3f} s median ({min:.3f} to {max:.3f})".format(**o["step_seconds"])),
        ("transformers: step time", "{median:.3f} s median ({min:.3f} to {max:.3f})".format(**t["step_seconds"])),
        ("transformers: of which features", "{median:.3f} s median".format(**t["features_seconds"])),
        ("ours: audio s/s (window s/s)", f"{o['audio_seconds_per_second']:.2f} ({o['window_seconds_per_second']:.1f})"),
        ("transformers: audio s/s (window s/s)", f"{t['audio_seconds_per_second']:.2f} ({t['window_seconds_per_second']:.1f})"),
        ("transformers without features", f"{t['without_features']['audio_seconds_per_second']:.2f} "
                                          f"({t['without_features']['window_seconds_per_second']:.1f})"),
        ("ratio ours / transformers", f"{r['ratio']['vs_step_with_features']:.2f}x (their features counted), "
                                      f"{r['ratio']['vs_step_without_features']:.2f}x (not counted); goal {r['goal_ratio']}x"),
        ("ratio per round", ", ".join(f"{x:.2f}x" for x in r["ratio"]["per_round_with_features"])),
        ("loss first -> last, ours / transformers", f"{o['loss_first_last'][0]:.3f} -> {o['loss_first_last'][1]:.3f} / "
                                                    f"{t['loss_first_last'][0]:.3f} -> {t['loss_first_last'][1]:.3f}"),
        ("peak host memory", f"{r['peak_rss_mib']:,.0f} MiB"),
    ]  # fmt: skip
    if r["profile_seconds"]:
        ours, theirs = r["profile_seconds"]["ours"], r["profile_seconds"]["transformers"]
        rows += [
            (f"profile: {name}", f"ours {sec:.3f} s, transformers {theirs[name]:.3f} s") for name, sec in ours.items()
        ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--preset", default="tiny", choices=sorted(PRESETS), help="model shapes and batch (default tiny)"
    )
    parser.add_argument(
        "--batch", type=int, default=None, help="rows per step (default: the preset's; a GPU wants more)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps of each side per round (default 2)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each side first (default 2)")
    parser.add_argument(
        "--layers",
        default=None,
        choices=sorted(LAYER_CHOICES),
        help="how our layers run (default: the preset's, the faster on the CPU)",
    )
    parser.add_argument(
        "--mp", default="p=f32", help="our trainer.mp; a bfloat16 compute dtype also runs theirs under autocast"
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "gpu"),
        help="cpu: both on the CPU; gpu: both on the GPU; auto: the GPU where there is one",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch.set_num_threads for theirs (default: the cores this process may use)",
    )
    parser.add_argument("--profile", action="store_true", help="also time pieces of our step")
    parser.add_argument("--workdir", default=None, help="where our trainer may write (default: a temp dir)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"  # before JAX is imported
    else:  # JAX would take 75% of the GPU's memory at start, and torch shares the GPU
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    results = benchmark(args.preset, batch_size=args.batch, rounds=args.rounds, steps=args.steps, warmup=max(1, args.warmup),
                        layers=args.layers, mp=args.mp, device=args.device, torch_threads=args.torch_threads,
                        profile=args.profile, workdir=args.workdir)  # fmt: skip
    print_table(results)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
