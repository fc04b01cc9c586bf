"""Whisper (speech recognition) for levanter-core."""
