"""A third-party architecture plugin written against the guide as it was before the architecture
kit (``tests/legacy-arch-plugin``: its own config, layers, stack and head composed from
``levanter_core.layers``, ``levanter_core.hf`` and ``levanter_core.models``, a module with its
own state-dict names through Haliax's ``ModuleWithStateDictSerialization``, registered as a class
object) still installs, trains, exports to Hugging Face and imports back with the same logits."""

import json
import os
import subprocess
import sys

import pytest

from conftest import CLI_IN_PROCESS, REPO

pytest.importorskip("transformers")
pytest.importorskip("torch")

PLUGIN = os.path.join(REPO, "tests", "legacy-arch-plugin")

SCRIPT = (
    CLI_IN_PROCESS
    + r"""
import json, os, sys
import numpy as np, transformers
from levanter_core.hf.bridge import export_hf, import_hf
from levanter_core.hf.parity import hf_logits, our_logits
from levanter_core.checkpoint import load_checkpoint, read_metadata
from levanter_core.config.base import validate_section
from haliax import Axis
import jax

nano, work = sys.argv[1:3]

listed = cli("plugins", "--json")
os.chdir(work)  # the config's relative directories are the working directory's
trained = cli("train", nano, "--trainer.id", "legacy", "--trainer.log_dir", f"{work}/logs",
              "--trainer.checkpointer.base_path", f"{work}/checkpoints", "--data.cache_dir", f"{work}/cache")
print(json.dumps({"listed": listed, "trained": trained}))
if trained[0] != 0:
    sys.exit(1)
checkpoint, exported, imported = f"{work}/checkpoints/legacy/step-8", f"{work}/hf", f"{work}/imported"

def load(path):
    stored = read_metadata(path)["metadata"]
    config = validate_section("model", stored["config"]["model"])
    Vocab = Axis("vocab", stored["vocab_size"])
    template = jax.eval_shape(lambda: config.build(Vocab, key=jax.random.PRNGKey(0)))
    return config, load_checkpoint(template, path, subtree="model")

config, ours = load(checkpoint)
tokens = np.random.default_rng(0).integers(0, 256, size=(2, 24))
expected = our_logits(ours, tokens)
export_hf(checkpoint, exported)
theirs = transformers.AutoModelForCausalLM.from_pretrained(exported, attn_implementation="eager").eval()
import_hf(exported, imported)
back_config, back = load(imported)
print(json.dumps({
    "type": config.type,
    "hf_class": type(theirs).__name__,
    "export_diff": float(np.abs(hf_logits(theirs, tokens) - expected).max()),
    "import_type": back_config.type,
    "import_diff": float(np.abs(our_logits(back, tokens) - expected).max()),
}))
"""
)


@pytest.mark.slow
def test_a_plugin_written_against_the_old_guide_installs_trains_and_round_trips(tmp_path):
    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(site), PLUGIN],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr
    env = {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    # The listing, the training run and the round trip through the CLI's entry point in one
    # process: one start (imports) instead of three, each step still the command a user runs.
    ran = subprocess.run(
        [sys.executable, "-c", SCRIPT, os.path.join(PLUGIN, "nano.yaml"), str(tmp_path)],
        capture_output=True, text=True, timeout=900, env={**os.environ, **env},
    )  # fmt: skip
    reports = [json.loads(line) for line in ran.stdout.splitlines() if line.startswith("{")]
    assert reports, ran.stdout[-3000:] + ran.stderr[-3000:]
    code, listed = reports[0]["listed"]
    assert code == 0, ran.stderr[-3000:]
    ours = {p["distribution"]: p for p in json.loads(listed)["plugins"]}["levanter-model-legacyqwen"]
    assert ours["error"] is None and ours["types"] == {"model": ["legacy_qwen"]}

    assert reports[0]["trained"][0] == 0, ran.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "legacy" / "step-8").is_dir()

    assert ran.returncode == 0 and len(reports) == 2, ran.stderr[-3000:]
    result = reports[1]
    assert result["type"] == "legacy_qwen" and result["hf_class"] == "Qwen2ForCausalLM"
    assert result["export_diff"] <= 1e-4
    # Hugging Face's qwen2 is claimed by levanter-model-qwen3: the export comes back as `qwen`
    assert result["import_type"] == "qwen" and result["import_diff"] <= 1e-4
