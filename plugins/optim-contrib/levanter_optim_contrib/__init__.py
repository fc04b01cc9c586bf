"""Optimizers beyond the built-in optax ones, registered with ``register_optimizers``.

Each is an :class:`~levanter_core.optim.OptimizerConfig` written the way a third party would
write one: the config's fields are Levanter's, ``build`` returns an optax transformation, and
what it needs beyond the gradients (Sophia's loss function, key and step count) comes from the
keyword arguments every ``update`` receives (:mod:`levanter_core.optim.step`).
"""
