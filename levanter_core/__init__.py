"""levanter-core: a small core for training language models in JAX, extended by plugins.

Importing this package is cheap: it does not import JAX. The pieces live in
sub-packages (``config``, ``plugins``, ``trainer``, ``data``, ``models``,
``optim``, ``tracker``, ``checkpoint``) and are imported where they are used.
"""

__version__ = "0.1.0"
