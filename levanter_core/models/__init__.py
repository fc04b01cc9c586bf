"""Language-model interfaces shared by every architecture plugin, and the decoder kit
(:mod:`levanter_core.models.decoder`) that decoder-only families configure."""

from levanter_core.models.decoder import Decoder, DecoderConfig, DecoderLayer, DecoderLM
from levanter_core.models.lm import LmConfig, LmHeadModel, next_token_loss

__all__ = ["Decoder", "DecoderConfig", "DecoderLM", "DecoderLayer", "LmConfig", "LmHeadModel", "next_token_loss"]
