"""Samples during training (``trainer.sample``): every ``interval`` steps the model continues a
few prompts, and the trackers get the text, so a run can be read as well as plotted."""

from __future__ import annotations

import logging

from pydantic import Field, PositiveInt

from levanter_core.config.base import ConfigModel
from levanter_core.config.types import Seed
from levanter_core.inference.engine import Engine
from levanter_core.inference.sampling import SamplingParams

logger = logging.getLogger(__name__)


class TrainingSamplesConfig(ConfigModel):
    """The ``trainer.sample`` section."""

    prompts: list[str] = Field(min_length=1)
    """The prompts to continue, encoded with the run's tokenizer."""
    interval: PositiveInt = 1000
    """Sample every this many steps, and after the last step."""
    max_new_tokens: PositiveInt = 32
    """Tokens generated per prompt."""
    temperature: float = Field(0.0, ge=0.0)
    """Softmax temperature; 0 (the default) is greedy, so samples compare across steps."""
    seed: Seed = 0
    """Seed of the random draws when ``temperature`` is above 0 (0 to 2^32 - 1)."""


def sample_texts(model, tokenizer, config: TrainingSamplesConfig, *, seq_len: int) -> dict[str, str]:
    """``{"samples/N": prompt + continuation}`` for each prompt (N from 0)."""
    eos = () if tokenizer.eos_id is None else (tokenizer.eos_id,)
    ids = [tokenizer.encode_batch([p])[0].tolist()[: seq_len - 1] for p in config.prompts]
    budget = max(1, min(config.max_new_tokens, seq_len - max(len(i) for i in ids)))
    params = SamplingParams(max_new_tokens=budget, temperature=config.temperature, seed=config.seed)
    with Engine(model, tokenizer=tokenizer, eos_ids=eos, max_seqs=len(ids), max_seq_len=seq_len) as engine:
        completions = engine.generate(ids, params)
    samples = {}
    for i, (prompt, row) in enumerate(zip(config.prompts, completions)):
        text = row[0].text
        assert text is not None, "an engine with a tokenizer decodes what it generates"
        samples[f"samples/{i}"] = prompt + text
    return samples
