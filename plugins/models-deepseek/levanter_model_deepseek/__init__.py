"""DeepSeek-V3 for levanter-core: ``type: deepseek_v3``."""
