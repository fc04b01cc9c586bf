"""levanter-eval-harness: EleutherAI's lm-evaluation-harness (the ``lm-eval`` package) over
levanter-core models: ``levanter eval-harness`` on the command line, and the ``eval_harness``
evaluator of training runs.

:class:`~levanter_eval_harness.lm.LevanterLM` is lm-eval's ``LM`` over one of our models;
:func:`~levanter_eval_harness.harness.evaluate` runs tasks with it and writes lm-eval's files.
"""
