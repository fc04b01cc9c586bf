"""Preference optimization for levanter-core: the ``preference`` data format (a chosen and a
rejected answer per record) and the ``dpo`` objective (direct preference optimization against a
frozen reference model)."""
