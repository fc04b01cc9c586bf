"""TensorStore checkpoints: round trips, discovery, the save policy, and refusing bad loads."""

import contextlib
import datetime
import json
import os
import resource
import shutil
import signal
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from pydantic import ValidationError

from levanter_core.checkpoint import (
    COMMIT_MARKER,
    METADATA_FILE,
    CheckpointInterval,
    TensorStoreCheckpointer,
    TensorStoreCheckpointerConfig,
    discover_latest,
    load_checkpoint,
    read_metadata,
)
from levanter_core.errors import CheckpointError, DamagedCheckpointError

In = hax.Axis("In", 3)


class TrainerState(eqx.Module):
    step: jax.Array
    model: hax.nn.Linear
    opt_state: Any
    training_key: jax.Array


def make_state(seed: int = 0, out_size: int = 4) -> TrainerState:
    model_key, training_key = jax.random.split(jax.random.key(seed))
    model = hax.nn.Linear.init(In, hax.Axis("Out", out_size), key=model_key)
    optimizer = optax.adam(1e-2)
    params = eqx.filter(model, eqx.is_array)
    opt_state = optimizer.init(params)
    # one update, so that Adam's moments are not all zeros
    grads = jax.tree.map(lambda p: jnp.full_like(p, seed + 1.0), params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return TrainerState(jnp.array(seed + 1, jnp.int32), eqx.apply_updates(model, updates), opt_state, training_key)


def raw_leaves(tree) -> list[np.ndarray]:
    """Every array leaf as NumPy (typed keys as their key data), for bitwise comparison."""
    leaves = jax.tree.leaves(eqx.filter(tree, eqx.is_array))
    return [np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x) for x in leaves]


def committed_steps(path) -> list[int]:
    return sorted(int(d.removeprefix("step-")) for d in os.listdir(path) if os.path.exists(path / d / COMMIT_MARKER))


def checkpointer(path, **kwargs) -> TensorStoreCheckpointer:
    kwargs.setdefault("save_interval", None)
    return TensorStoreCheckpointer(str(path), **kwargs)


def save_now(path, state, step, **kwargs) -> str:
    """Save ``state`` as step ``step`` under ``path`` and wait for the background write."""
    ckpt = checkpointer(path, **kwargs)
    saved = ckpt.save(state, step, temporary=False)
    ckpt.wait_until_finished()
    return saved


def test_round_trip_is_bitwise_equal_and_keeps_sharding_and_structure(tmp_path):
    state = make_state(seed=0)
    expected = raw_leaves(state)
    ckpt = checkpointer(tmp_path)
    saved = ckpt.save(state, 7, temporary=False)
    # The save copied what it needs before returning: the training step that follows may
    # reuse (donate) the buffers while the background write goes on.
    for x in jax.tree.leaves(eqx.filter(state, eqx.is_array)):
        x.delete()
    ckpt.wait_until_finished()

    assert saved == str(tmp_path / "step-7")
    for name in ("step", "model/weight", "model/bias", "opt_state/0/count", "opt_state/0/mu/weight", "training_key"):
        assert os.path.exists(tmp_path / "step-7" / name / ".zarray"), name

    mesh = Mesh(np.array(jax.devices()), ("data",))
    template = jax.device_put(make_state(seed=1), NamedSharding(mesh, PartitionSpec()))
    loaded = load_checkpoint(template, saved)

    assert jax.tree.structure(loaded) == jax.tree.structure(state)
    assert loaded.training_key.dtype == state.training_key.dtype
    for want, got in zip(expected, raw_leaves(loaded), strict=True):
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    for t, got in zip(jax.tree.leaves(template), jax.tree.leaves(loaded), strict=True):
        assert got.sharding == t.sharding

    # a template of shapes only (what a resuming trainer has) loads the same values
    from_shapes = load_checkpoint(eqx.filter_eval_shape(make_state, 1), str(tmp_path))
    for want, got in zip(expected, raw_leaves(from_shapes), strict=True):
        assert got.tobytes() == want.tobytes()


def test_latest_ignores_uncommitted_and_staging_directories(tmp_path):
    state = make_state()
    save_now(tmp_path, state, 2)
    ckpt = checkpointer(tmp_path)
    ckpt.save(state, 5, temporary=True)
    ckpt.wait_until_finished()
    (tmp_path / "step-9").mkdir()  # damaged: no marker
    staging = tmp_path / "step-12.tmp-0000abcd"  # committed but never renamed into place
    staging.mkdir()
    (staging / COMMIT_MARKER).write_text("")

    assert ckpt.latest() == str(tmp_path / "step-5")
    assert discover_latest(str(tmp_path)) == str(tmp_path / "step-5")
    assert discover_latest(str(tmp_path / "step-2")) == str(tmp_path / "step-2")
    assert discover_latest(str(tmp_path / "step-9")) is None
    assert discover_latest(str(tmp_path / "nowhere")) is None


def test_keep_intervals_count_multiples_of_every_until_their_until(tmp_path):
    # The first interval whose `until` a step has not passed decides, by `step % every == 0`
    # (as in Levanter): every 3 up to 6, then every 5 -> 10, 15, 20 (not 11, 16).
    keep = [CheckpointInterval(every=3, until=6), CheckpointInterval(every=5)]
    ckpt = checkpointer(tmp_path, keep=keep)
    state = make_state()
    for step in range(21):
        ckpt.on_step(state, step)
    ckpt.wait_until_finished()
    assert committed_steps(tmp_path) == [3, 6, 10, 15, 20]

    ckpt.on_step(state, 22, force=True)  # the end of training
    ckpt.wait_until_finished()
    assert committed_steps(tmp_path) == [3, 6, 10, 15, 20, 22]
    assert not any(read_metadata(str(tmp_path / f"step-{s}"))["temporary"] for s in committed_steps(tmp_path))


class RecordingCheckpointer(TensorStoreCheckpointer):
    """Records which checkpoint was the latest complete one when each deletion happened."""

    def delete(self, checkpoint_path):
        self.deletions.append((os.path.basename(checkpoint_path), os.path.basename(self.latest())))
        super().delete(checkpoint_path)


def test_time_policy_saves_temporary_checkpoints_and_deletes_each_after_the_next_commit(tmp_path):
    clock = [datetime.datetime(2026, 1, 1)]
    ckpt = RecordingCheckpointer(
        str(tmp_path),
        save_interval=datetime.timedelta(minutes=5),
        keep=[CheckpointInterval(every=6)],
        now=lambda: clock[0],
    )
    ckpt.deletions = []
    state = make_state()
    for step in range(1, 9):  # three minutes per step
        clock[0] += datetime.timedelta(minutes=3)
        ckpt.on_step(state, step)
        if step == 2:
            ckpt.wait_until_finished()
            assert committed_steps(tmp_path) == [2]
            assert read_metadata(str(tmp_path / "step-2"))["temporary"]

    # temporary at 2, 4 and 8 (5 minutes since the last save), permanent at 6
    ckpt.wait_until_finished()
    assert committed_steps(tmp_path) == [6, 8]
    assert ckpt.deletions == [("step-2", "step-4"), ("step-4", "step-6")]
    assert read_metadata(str(tmp_path / "step-8"))["temporary"]

    # a restarted run deletes the previous attempt's temporary checkpoint after its first save
    restarted = RecordingCheckpointer(str(tmp_path), save_interval=None, keep=[CheckpointInterval(every=6)])
    restarted.deletions = []
    restarted.on_step(state, 12)
    restarted.wait_until_finished()
    assert committed_steps(tmp_path) == [6, 12]
    assert restarted.deletions == [("step-8", "step-12")]


def test_forced_save_at_a_temporary_step_makes_it_permanent(tmp_path):
    clock = [datetime.datetime(2026, 1, 1)]
    ckpt = checkpointer(tmp_path, save_interval=datetime.timedelta(seconds=30), now=lambda: clock[0])
    clock[0] += datetime.timedelta(minutes=1)
    ckpt.on_step(make_state(), 5)
    ckpt.wait_until_finished()
    assert read_metadata(str(tmp_path / "step-5"))["temporary"]

    ckpt.on_step(make_state(), 5, force=True)
    assert not read_metadata(str(tmp_path / "step-5"))["temporary"]
    # a later run keeps it
    later = checkpointer(tmp_path)
    later.on_step(make_state(), 10000)
    later.wait_until_finished()
    assert committed_steps(tmp_path) == [5, 10000]


def test_a_failed_save_leaves_no_debris_and_the_previous_checkpoint_latest(tmp_path):
    ckpt = checkpointer(tmp_path)
    state = make_state()
    ckpt.save(state, 1, temporary=False)
    ckpt.wait_until_finished()
    donated = make_state()
    donated.model.weight.array.delete()  # what a train step that donated its buffers leaves behind

    with pytest.raises(RuntimeError, match="deleted"):
        ckpt.save(donated, 2, temporary=False)
    assert sorted(os.listdir(tmp_path)) == ["step-1"]
    assert ckpt.latest() == str(tmp_path / "step-1")


def test_template_with_a_different_shape_is_refused_naming_every_leaf(tmp_path):
    saved = save_now(tmp_path, make_state(out_size=4), 1)

    with pytest.raises(CheckpointError) as e:
        load_checkpoint(eqx.filter_eval_shape(make_state, 0, 5), saved)
    message = str(e.value)
    assert "model/weight: expected float32[5, 3], found float32[4, 3]" in message
    assert "opt_state/0/nu/bias: expected float32[5], found float32[4]" in message
    assert "6 leaves differ" in message

    template = {"model": eqx.filter_eval_shape(make_state, 0, 4).model, "ema": jax.ShapeDtypeStruct((2,), jnp.float32)}
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(template, saved)
    assert "ema: expected float32[2], missing from the checkpoint" in str(e.value)
    assert "training_key: found key<fry>[], which the training state does not have" in str(e.value)


def test_a_missing_chunk_is_an_error_not_zeros(tmp_path):
    saved = save_now(tmp_path, make_state(), 1)
    weight_dir = os.path.join(saved, "model", "weight")
    chunks = [f for f in os.listdir(weight_dir) if not f.startswith(".")]
    assert chunks
    os.remove(os.path.join(weight_dir, chunks[0]))

    with pytest.raises(CheckpointError, match=r"model/weight: .*missing"):
        load_checkpoint(eqx.filter_eval_shape(make_state, 0), saved)


def test_config_creates_a_checkpointer_whose_metadata_round_trips(tmp_path):
    config = TensorStoreCheckpointerConfig(base_path=str(tmp_path), save_interval="5m")
    run_metadata = {"config": {"model": {"type": "gpt2", "hidden_dim": 8}}, "plugins": {"levanter-core": "0.1.0"}}
    ckpt = config.create("run-1", metadata=run_metadata)
    assert ckpt.path == str(tmp_path / "run-1")

    ckpt.save(make_state(), 3, temporary=False)
    ckpt.wait_until_finished()
    metadata = read_metadata(ckpt.latest())
    assert metadata["metadata"] == run_metadata
    assert metadata["step"] == 3 and metadata["temporary"] is False and metadata["timestamp"]
    leaves = {leaf["name"]: leaf for leaf in metadata["leaves"]}
    assert leaves["model/weight"]["shape"] == [4, 3] and leaves["model/weight"]["dtype"] == "float32"
    assert leaves["training_key"]["dtype"] == "key<fry>" and leaves["training_key"]["key_impl"] == "threefry2x32"
    with open(os.path.join(ckpt.latest(), "metadata.json")) as f:
        assert json.load(f) == metadata

    same_dir = config.model_copy(update={"append_run_id_to_base_path": False})
    assert same_dir.expanded_path("run-1") == str(tmp_path)


def test_checkpointer_config_fields():
    assert TensorStoreCheckpointerConfig(save_interval="5m").save_interval == datetime.timedelta(minutes=5)
    assert TensorStoreCheckpointerConfig(save_interval="30s").save_interval == datetime.timedelta(seconds=30)
    default = TensorStoreCheckpointerConfig()
    assert default.save_interval == datetime.timedelta(minutes=15)
    assert default.keep == [CheckpointInterval(every=10000)]
    assert default.model_dump(mode="json")["save_interval"] == "15m"

    with pytest.raises(ValidationError, match="duration"):
        TensorStoreCheckpointerConfig(save_interval="soon")
    with pytest.raises(ValidationError, match="only the last interval may omit `until`"):
        TensorStoreCheckpointerConfig(keep=[{"every": 100}, {"every": 1000}])


# -- damage, fallback, and failures --------------------------------------------------------


def plant_damage(checkpoint: str, kind: str) -> None:
    """Damage ``checkpoint`` the way a bad disk, an interrupted copy or a careless hand would."""
    marker = os.path.join(checkpoint, COMMIT_MARKER)
    weight = os.path.join(checkpoint, "model", "weight")
    if kind == "missing chunk":
        os.remove(os.path.join(weight, next(f for f in os.listdir(weight) if not f.startswith("."))))
    elif kind == "truncated marker":
        with open(marker, "rb") as f:
            content = f.read()
        with open(marker, "wb") as f:
            f.write(content[: len(content) // 2])
    elif kind == "corrupt marker":
        with open(marker, "wb") as f:
            f.write(os.urandom(24))
    elif kind == "deleted array":
        shutil.rmtree(os.path.join(checkpoint, "opt_state", "0", "mu", "bias"))
    elif kind == "deleted marker":
        os.remove(marker)
    elif kind == "corrupt metadata":
        with open(os.path.join(checkpoint, METADATA_FILE), "w") as f:
            f.write('{"step": 6, "leaves": [')
    else:
        raise ValueError(kind)


DAMAGE = ["missing chunk", "truncated marker", "corrupt marker", "deleted array", "deleted marker", "corrupt metadata"]


def saved_steps(tmp_path, steps) -> dict[int, list[np.ndarray]]:
    """Save a distinct state at each of ``steps``; return each one's leaves."""
    ckpt = checkpointer(tmp_path)
    leaves = {}
    for step in steps:
        state = make_state(seed=step)
        leaves[step] = raw_leaves(state)
        ckpt.save(state, step, temporary=False)
    ckpt.wait_until_finished()
    return leaves


@pytest.mark.parametrize("kind", DAMAGE)
def test_resume_skips_a_damaged_newest_checkpoint_for_the_newest_that_loads(tmp_path, capsys, kind):
    leaves = saved_steps(tmp_path, [2, 4, 6])
    plant_damage(str(tmp_path / "step-6"), kind)

    ckpt = checkpointer(tmp_path)
    state, path = ckpt.resume(eqx.filter_eval_shape(make_state, 0))

    assert path == str(tmp_path / "step-4")
    assert [x.tobytes() for x in raw_leaves(state)] == [x.tobytes() for x in leaves[4]]
    out = capsys.readouterr().out
    assert f"skipped damaged checkpoint {tmp_path}/step-6" in out
    assert f"resuming from {tmp_path}/step-4" in out
    # the damaged one is kept, out of the way of the run's next save of step 6
    aside = [d for d in os.listdir(tmp_path) if d.startswith("step-6.damaged-")]
    assert len(aside) == 1 and not (tmp_path / "step-6").exists()
    ckpt.on_step(make_state(seed=60), 6, force=True)
    ckpt.wait_until_finished()
    assert ckpt.latest() == str(tmp_path / "step-6")


def test_the_damage_is_named_in_the_report(tmp_path, capsys):
    saved_steps(tmp_path, [2, 4, 6, 8])
    plant_damage(str(tmp_path / "step-8"), "missing chunk")
    plant_damage(str(tmp_path / "step-6"), "corrupt marker")

    _, path = checkpointer(tmp_path).resume(eqx.filter_eval_shape(make_state, 0))
    assert path == str(tmp_path / "step-4")
    out = capsys.readouterr().out
    assert "model/weight" in out and "missing" in out  # which array, and what is wrong with it
    assert "COMMITTED marker is corrupt or truncated" in out


def test_when_every_checkpoint_is_damaged_resume_fails_and_moves_nothing(tmp_path):
    saved_steps(tmp_path, [2, 4])
    plant_damage(str(tmp_path / "step-4"), "deleted array")
    plant_damage(str(tmp_path / "step-2"), "truncated marker")

    with pytest.raises(CheckpointError) as e:
        checkpointer(tmp_path).resume(eqx.filter_eval_shape(make_state, 0))
    message = str(e.value)
    assert "every checkpoint under" in message and "Refusing to start again from step 0" in message
    assert f"{tmp_path}/step-4: " in message and f"{tmp_path}/step-2: " in message
    assert sorted(os.listdir(tmp_path)) == ["step-2", "step-4"]


def test_a_checkpoint_that_does_not_fit_is_an_error_not_a_fallback(tmp_path):
    saved_steps(tmp_path, [2, 4])
    with pytest.raises(CheckpointError, match="does not fit the training state") as e:
        checkpointer(tmp_path).resume(eqx.filter_eval_shape(make_state, 0, 5))
    assert not isinstance(e.value, DamagedCheckpointError)
    assert sorted(os.listdir(tmp_path)) == ["step-2", "step-4"]


def test_naming_one_damaged_checkpoint_is_an_error(tmp_path):
    saved_steps(tmp_path, [2, 4])
    plant_damage(str(tmp_path / "step-4"), "corrupt marker")
    with pytest.raises(CheckpointError, match="step-4 is damaged: its COMMITTED marker is corrupt"):
        load_checkpoint(eqx.filter_eval_shape(make_state, 0), str(tmp_path / "step-4"))
    assert discover_latest(str(tmp_path)) == str(tmp_path / "step-2")


def test_a_new_checkpointer_removes_what_dead_saves_left_and_keeps_the_rest(tmp_path):
    saved_steps(tmp_path, [2])
    for debris in ("step-4.tmp-0badc0de", "step-2.deleting-00ff00ff", "step-3.damaged-12345678"):
        (tmp_path / debris).mkdir()
        (tmp_path / debris / "x").write_text("partial")
    checkpointer(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["step-2", "step-3.damaged-12345678"]


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """Writes past ``nbytes`` into any file fail with EFBIG, as on a full disk or quota."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write, not the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_a_failed_background_save_stops_the_run_at_the_next_step(tmp_path):
    path = tmp_path / "ckpt"
    ckpt = checkpointer(path, keep=[CheckpointInterval(every=1)])
    big = make_state(out_size=4096)  # a 48 KiB weight
    ckpt.on_step(big, 1)
    ckpt.wait_until_finished()

    with file_size_limit(8192):
        ckpt.on_step(big, 2)  # returns at once: the write goes on in the background
        with pytest.raises(CheckpointError, match=r"saving a checkpoint under .* failed: .*File too large") as e:
            ckpt.on_step(big, 3)  # the next step reports the failure (its save would wait for it)
    assert f"it resumes from {path}/step-1" in str(e.value)
    # nothing half-written is left, and the checkpoint before is intact
    assert sorted(os.listdir(path)) == ["step-1"]
    loaded = load_checkpoint(eqx.filter_eval_shape(make_state, 0, 4096), str(path))
    assert [x.tobytes() for x in raw_leaves(loaded)] == [x.tobytes() for x in raw_leaves(big)]


# -- checksums -------------------------------------------------------------------------------


def flip_one_bit(chunk_file: str) -> None:
    """Flip one bit in the middle of a chunk file, as a bad disk or a faulty copy would: in a
    zstd frame of random weights that lands in the stored bytes of one value, which decompress
    without complaint."""
    with open(chunk_file, "rb") as f:
        raw = bytearray(f.read())
    raw[len(raw) // 2] ^= 0x04
    with open(chunk_file, "wb") as f:
        f.write(raw)


def test_a_flipped_bit_in_a_chunk_is_damage_naming_the_array_and_the_previous_checkpoint_loads(tmp_path, capsys):
    ckpt = checkpointer(tmp_path)
    states = {step: make_state(seed=step, out_size=512) for step in (2, 4)}  # a 6 KiB weight
    for step, state in states.items():
        ckpt.save(state, step, temporary=False)
    ckpt.wait_until_finished()
    flip_one_bit(str(tmp_path / "step-4" / "model" / "weight" / "0.0"))

    state, path = checkpointer(tmp_path).resume(eqx.filter_eval_shape(make_state, 0, 512))

    assert path == str(tmp_path / "step-2")
    assert [x.tobytes() for x in raw_leaves(state)] == [x.tobytes() for x in raw_leaves(states[2])]
    out = capsys.readouterr().out
    assert f"skipped damaged checkpoint {tmp_path}/step-4" in out
    assert "model/weight: chunk 0.0 reads with xxh3_64" in out and "checksums do not match" in out
    assert [d for d in os.listdir(tmp_path) if d.startswith("step-4.damaged-")]


def test_every_chunk_is_checksummed_and_checked_also_where_a_shard_holds_several(tmp_path):
    """A shard too big for one chunk is cut into several, each with its own checksum; loading
    puts them together again, and a flipped bit in any one of them is found."""
    big = {"w": jnp.arange(4096 * 8, dtype=jnp.float32).reshape(4096, 8) * 1.5, "s": jnp.float32(2.0)}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("levanter_core.checkpoint.chunks._MAX_CHUNK_BYTES", 32 << 10)  # 4 chunks of w
        saved = save_now(tmp_path, big, 1)
    leaves = {leaf["name"]: leaf for leaf in read_metadata(saved)["leaves"]}
    assert sorted(leaves["w"]["xxh3_64"]) == ["0.0", "1.0", "2.0", "3.0"] and list(leaves["s"]["xxh3_64"]) == ["0"]

    devices = np.array(jax.devices()[:1])
    template = {"w": jax.ShapeDtypeStruct((4096, 8), jnp.float32, sharding=NamedSharding(Mesh(devices, ("d",)), PartitionSpec())),
                "s": jax.ShapeDtypeStruct((), jnp.float32)}  # fmt: skip
    loaded = load_checkpoint(template, saved)
    assert np.asarray(loaded["w"]).tobytes() == np.asarray(big["w"]).tobytes() and float(loaded["s"]) == 2.0

    flip_one_bit(os.path.join(saved, "w", "2.0"))
    with pytest.raises(
        DamagedCheckpointError, match=r"w: chunk 2\.0 reads with xxh3_64 [0-9a-f]{16}, it was saved with"
    ):
        load_checkpoint(template, saved)
