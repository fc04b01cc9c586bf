"""Language-model interfaces shared by every architecture plugin."""

from levanter_core.models.lm import LmConfig, LmHeadModel, next_token_loss

__all__ = ["LmConfig", "LmHeadModel", "next_token_loss"]
