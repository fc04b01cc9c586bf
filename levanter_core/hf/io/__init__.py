"""Reading and writing Hugging Face model directories, one job a module.

:mod:`~levanter_core.hf.io.source` finds a model source (a local directory or a hub name) and
reads its ``config.json`` into our model config; :mod:`~levanter_core.hf.io.vocab` checks a
tokenizer against a checkpoint's vocabulary and resizes it; :mod:`~levanter_core.hf.io.importer`
loads a Hugging Face model as ours and writes it as our checkpoint (``levanter import-hf``);
:mod:`~levanter_core.hf.io.checkpoint_model` loads the model of one of our checkpoints;
:mod:`~levanter_core.hf.io.exporter` writes our model as a Hugging Face model directory
(``levanter export-hf``); :mod:`~levanter_core.hf.io.tokenizer_files`,
:mod:`~levanter_core.hf.io.special_tokens` and :mod:`~levanter_core.hf.io.chat_template` the
tokenizer files that travel with a model, the special token ids of its ``config.json`` and the
chat template it was trained with. :mod:`levanter_core.hf.bridge` is the public face: every name
imported from it.
"""
