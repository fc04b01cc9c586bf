import json
import math
import os
import re

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import pytest
import transformers

from levanter_core.errors import CheckpointError
from levanter_core.hf import to_hf_state_dict
from levanter_core.hf.convert import from_hf_state_dict
from levanter_core.hf.bridge import config_from_hf
from levanter_core.hf.parity import check_hf_parity
from levanter_core.testing import train_briefly
from levanter_model_olmo.olmo2 import Olmo2Config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
)

VARIANTS = {
    "mha": dict(num_key_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "gqa_llama3_bias": dict(
        num_key_value_heads=2,
        attention_bias=True,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "gqa_yarn_tied": dict(
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 16.0,  # not the default, so it must survive the round trip
        },
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_parity_with_transformers(variant, tmp_path):
    report = check_hf_parity(transformers.Olmo2Config(**COMMON, **VARIANTS[variant]), str(tmp_path))
    assert report.import_max_abs_diff <= 1e-4
    assert report.export_max_abs_diff <= 1e-4
    assert report.config_differences == {}
    assert report.export_config_differences == {}
    assert report.shards > 1



def test_unrolled_layers_match_transformers(tmp_path):
    hf_config = transformers.Olmo2Config(**COMMON, **VARIANTS["gqa_llama3_bias"])
    report = check_hf_parity(hf_config, str(tmp_path), scan_layers=False)
    assert report.import_max_abs_diff <= 1e-4
    assert report.export_max_abs_diff <= 1e-4
    assert report.export_config_differences == {}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor = 0.5"),
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 5e5}), "rope type 'dynamic'"),
    ],
)
def test_unsupported_rotary_settings_are_refused_by_name(overrides, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config_from_hf(transformers.Olmo2Config(**COMMON, num_key_value_heads=2, **overrides).to_dict())

def test_nano_config_trains(tmp_path):
    result = train_briefly(os.path.join(REPO, "config", "olmo2_nano.yaml"), str(tmp_path))
    with open(os.path.join(result.run_dir, "metrics.jsonl")) as f:
        losses = [record["train/loss"] for record in map(json.loads, f) if "train/loss" in record]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)
    assert result.final_eval_loss < result.initial_eval_loss


def test_unscanned_layers_have_the_same_checkpoint_layout():
    config = Olmo2Config(seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2)
    Vocab = hax.Axis("vocab", 64)
    scanned = config.build(Vocab, key=jax.random.PRNGKey(0))
    state_dict = to_hf_state_dict(scanned)

    unscanned_config = config.model_copy(update={"scan_layers": False})
    template = eqx.filter_eval_shape(lambda: unscanned_config.build(Vocab, key=jax.random.PRNGKey(1)))
    unscanned = from_hf_state_dict(template, state_dict)

    assert to_hf_state_dict(unscanned).keys() == state_dict.keys()
    ids = hax.random.randint(jax.random.PRNGKey(2), (hax.Axis("batch", 2), config.Pos), 0, Vocab.size)
    forward = eqx.filter_jit(lambda model, ids: model(ids))
    np.testing.assert_allclose(forward(unscanned, ids).array, forward(scanned, ids).array, atol=1e-5)
