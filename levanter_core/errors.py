"""Errors meant for people.

Every error that is the user's to fix (a bad config, a missing file, a bad data
line, a checkpoint that does not fit) is a :class:`UserError`. The CLI prints
its message, with no traceback, and exits with status 2. Anything else is a
bug or an environment failure and exits with status 1.
"""


class LevanterError(Exception):
    """Base class of the errors levanter raises on purpose."""


class UserError(LevanterError):
    """Something the user can fix: the message says what, where, and how."""

    exit_code = 2


class ConfigError(UserError):
    """A configuration that cannot be loaded or validated."""


class PluginError(UserError):
    """A plugin that cannot be used (duplicate type name, bad registration)."""


class DataError(UserError):
    """Input data that cannot be read or tokenized."""


class DataExhausted(DataError):
    """The training stream has ended (``data.stop_strategy`` ``first_exhausted`` or
    ``all_exhausted``, or the top-level ``epoch``): the batch of ``step`` would read past its
    end. The message says which source ran out and why."""

    def __init__(self, step: int, message: str):
        super().__init__(step, message)
        self.step = step
        self.message = message

    def __str__(self) -> str:
        return self.message


class CheckpointError(UserError):
    """A checkpoint that cannot be found, read, or does not fit the model."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint whose marker, metadata or arrays cannot be read: resuming falls back to an
    older one. (A checkpoint that reads fine but does not fit the model is a plain
    :class:`CheckpointError`: an older one would not fit either.)"""
