"""``levanter export-hf`` treats its OUTPUT as ``import-hf`` does (an existing, non-empty folder
is refused unless ``--overwrite``) and writes files everyone may read, as the umask allows."""

import os
import stat

import jax
import pytest
from haliax import Axis

from levanter_core.checkpoint import write_checkpoint
from levanter_core.cli import main
from levanter_core.testing import MODEL


@pytest.fixture
def checkpoint(tmp_path) -> str:
    from levanter_core.config.base import validate_section

    config = validate_section("model", MODEL)
    model = config.build(Axis("vocab", 257), key=jax.random.PRNGKey(0))
    metadata = {"config": {"model": config.model_dump(mode="json"), "data": {"tokenizer": "byte"}}, "vocab_size": 257}
    write_checkpoint({"model": model}, str(tmp_path / "ckpt"), step=1, metadata=metadata)
    return str(tmp_path / "ckpt")


def export(capsys, *args) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["export-hf", *args])
    return exit_info.value.code, capsys.readouterr().err


def test_a_non_empty_output_is_refused_unless_overwrite(checkpoint, tmp_path, capsys):
    output = tmp_path / "exported"
    output.mkdir()  # an empty folder is fine
    assert export(capsys, checkpoint, str(output)) == (0, "")
    (output / "model-00009-of-00009.safetensors").write_bytes(b"a shard of an older export")
    before = {p.name: p.stat().st_mtime_ns for p in output.iterdir()}

    code, err = export(capsys, checkpoint, str(output))
    assert code == 2 and "exists and is not empty" in err and "--overwrite" in err
    assert {p.name: p.stat().st_mtime_ns for p in output.iterdir()} == before  # nothing touched

    code, err = export(capsys, checkpoint, str(output), "--overwrite")
    assert code == 0, err
    assert not (output / "model-00009-of-00009.safetensors").exists()  # no stale shard beside the new ones
    assert (output / "model-00001-of-00001.safetensors").exists()


def test_exported_files_are_readable_as_the_umask_allows(checkpoint, tmp_path, capsys):
    previous = os.umask(0o022)
    try:
        assert export(capsys, checkpoint, str(tmp_path / "exported"))[0] == 0
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "exported").iterdir()}
    assert any(name.endswith(".safetensors") for name in modes)
    assert set(modes.values()) == {0o644}, modes
