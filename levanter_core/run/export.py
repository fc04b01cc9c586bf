"""Hugging Face (and PEFT) exports while a run trains: ``hf_save_path``, ``hf_save_steps``,
``peft_save_path``, ``hf_upload``."""

from __future__ import annotations

import logging
import os

import jax
from huggingface_hub import upload_folder
from jax.experimental import multihost_utils

from levanter_core import distributed
from levanter_core.config.train import TrainConfig
from levanter_core.errors import CheckpointError, ConfigError
from levanter_core.fileio import is_local, join
from levanter_core.hf.bridge import _write_tokenizer, local_output, read_hf_config, write_hf_model
from levanter_core.hf.checkpoint import upload_hf_directory
from levanter_core.hf.convert import HfConvertible
from levanter_core.hf.peft import check_peft_form, task_type_of, write_peft_adapter

logger = logging.getLogger("levanter_core.trainer.run")


def run_subdirectory(path: str | None, run_id: str) -> str | None:
    if not path:
        return None
    return os.path.join(os.path.expanduser(path), run_id) if is_local(path) else join(path, run_id)


class HfExporter:
    """Hugging Face exports during training (``hf_save_path``, ``hf_save_steps``, ``hf_upload``,
    ``hf_save_dtype``): the model evaluation uses, as ``levanter export-hf`` would write it, to
    ``{hf_save_path}/{run_id}/step-N/``, a local directory or an object-store URL (written
    locally first, then uploaded, its safetensors index last)."""

    _DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}

    def __init__(self, config: TrainConfig, run_id: str, model_config, Vocab, tokenizer, resolved: dict, hf_directory):
        self.config, self.model_config, self.Vocab, self.tokenizer = config, model_config, Vocab, tokenizer
        self.run_id = run_id
        self.directory = run_subdirectory(config.hf_save_path, run_id)
        self.peft_directory = run_subdirectory(config.peft_save_path, run_id)
        self.resolved = resolved
        self.imported = read_hf_config(hf_directory) if hf_directory else None
        dtype = config.hf_save_dtype or "float32"
        self.dtype = self._DTYPES.get(dtype, dtype)
        self.last_step: int | None = None

    def check(self, model=None) -> None:
        """Refuse, before training, a model that has no Hugging Face form, or (``model``, with
        ``peft_save_path``) adapters that have no PEFT form."""
        if self.peft_directory is not None and model is not None and jax.process_count() == 1:
            try:
                check_peft_form(model)
            except CheckpointError as e:
                raise ConfigError(f"peft_save_path: {e}") from None
        if not self.config.hf_save_path:
            return
        if not isinstance(self.model_config, HfConvertible):
            raise ConfigError(f"hf_save_path: model type {self.model_config.type!r} has no Hugging Face form to save")
        try:
            self.model_config.to_hf_config(self.Vocab.size)
        except ValueError as e:
            raise ConfigError(f"hf_save_path: the model cannot be saved in Hugging Face form: {e}") from None

    def export(self, model, step: int) -> str | None:
        if jax.process_count() > 1:  # every process holds a part; process 0 writes the whole
            model = multihost_utils.process_allgather(model, tiled=True)
        self.last_step = step
        if self.peft_directory is not None and distributed.is_leader():
            self._export_peft(model, step)
        if self.directory is None:
            return None
        output = join(self.directory, f"step-{step}")
        if not distributed.is_leader():
            return output
        with local_output(output) as written:
            write_hf_model(
                model, self.model_config, self.Vocab, written, run_config=self.resolved,
                imported_hf_config=self.imported, tokenizer=self.tokenizer, dtype=self.dtype,
            )  # fmt: skip
            if not is_local(output):
                upload_hf_directory(written, output)
            print(f"saved the model in Hugging Face form to {output}", flush=True)
            if self.config.hf_upload:
                self._upload(written, step, self.config.hf_upload, "hf_upload")
        return output

    def _export_peft(self, model, step: int) -> None:
        """The adapters as a PEFT adapter directory ``{peft_save_path}/{run_id}/step-N``."""
        assert self.peft_directory is not None and self.config.lora is not None  # peft_save_path needs lora
        output = join(self.peft_directory, f"step-{step}")
        with local_output(output) as written:
            write_peft_adapter(
                model, self.config.lora, written, base_model_name_or_path=self.config.hf_source,
                task_type=task_type_of(self.model_config, self.Vocab.size),
            )  # fmt: skip
            _write_tokenizer((), self.resolved, written, self.tokenizer)
            if not is_local(output):
                upload_hf_directory(written, output)
            print(f"saved the LoRA adapters in PEFT form to {output}", flush=True)
            if self.config.peft_hf_upload:
                self._upload(written, step, self.config.peft_hf_upload, "peft_hf_upload")

    def _upload(self, written: str, step: int, repo: str, field: str) -> None:
        """Send the export in the local directory ``written`` to the hub repository ``repo``
        (the config's ``field``)."""
        try:
            upload_folder(repo_id=repo, folder_path=written, commit_message=f"step {step} of {self.run_id}")
            print(f"uploaded step {step} to the Hugging Face hub repository {repo}", flush=True)
        except Exception as e:  # the network or the hub; the export on disk stands, training goes on
            logger.error("%s: could not upload %s to %s: %s", field, written, repo, e)
            print(f"{field}: could not upload step {step} to {repo}: {e}", flush=True)
