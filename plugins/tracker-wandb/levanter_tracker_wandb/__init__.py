"""Weights & Biases tracker for levanter-core: ``trainer.tracker: [{type: wandb, ...}]``.

``tracker`` holds the config and the tracker, ``code`` the git sniffing behind
``save_code``, ``offline`` a reader of offline runs (what ``wandb sync`` would upload).
"""
