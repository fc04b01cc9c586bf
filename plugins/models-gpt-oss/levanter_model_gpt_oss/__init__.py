"""gpt-oss for levanter-core: ``type: gpt_oss``."""
