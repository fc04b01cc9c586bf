"""``trainer.mesh``: Levanter's spelling of the device mesh and the axis mappings, and the
trainer's own fields (``model_axis_size``, ``tensor_parallel_axes``, ``fsdp_axis``...), which
are translated into it: the same mappings, the same mesh, and errors that name the field the
config wrote."""

import json
import os
import subprocess
import sys

import pytest
import yaml
from pydantic import ValidationError

from conftest import REPO
from levanter_core.config.train import load_train_config
from levanter_core.errors import ConfigError
from levanter_core.testing import simulated_devices
from levanter_core.trainer.config import TrainerConfig
from levanter_core.trainer.mesh_config import MeshConfig

DP = ("replica_dcn", "replica", "data")
"""Where the batch goes by default."""


def trainer(**fields) -> TrainerConfig:
    return TrainerConfig.model_validate(fields)


def mappings(config: TrainerConfig) -> tuple[dict, dict]:
    return config.compute_axis_mapping(), config.parameter_axis_mapping()


# -- the trainer's own fields: the mappings they gave before trainer.mesh existed --------------

OWN_FIELDS = {
    "gpt2_nano": (
        yaml.safe_load(open(os.path.join(REPO, "config", "gpt2_nano.yaml")))["trainer"],
        {"batch": DP},
        {"embed": "data"},
    ),
    "tensor-parallel": (
        {"model_axis_size": 2, "tensor_parallel_axes": ["mlp", "heads"]},
        {"batch": DP, "mlp": "model", "heads": "model", "kv_heads": "model"},
        {"embed": "data", "mlp": "model", "heads": "model", "kv_heads": "model"},
    ),
    "no-fsdp": ({"fsdp_axis": None}, {"batch": DP}, {}),
    "axis-resources": (
        {
            "axis_resources": {"mlp": "model", "vocab": ["data", "model"]},
            "parameter_axis_resources": {"embed": ["replica", "data"]},
            "compute_axis_resources": {"position": "model"},
        },
        {"batch": DP, "mlp": "model", "vocab": ("data", "model"), "position": "model"},
        {"embed": ("replica", "data"), "mlp": "model", "vocab": ("data", "model")},
    ),
    "fsdp-overridden": (
        {"fsdp_axis": ["embed", "mlp"], "axis_resources": {"embed": "model"}, "batch_axis": "rows"},
        {"rows": DP, "embed": "model"},
        {"embed": "model", "mlp": "data"},
    ),
    "heads-mapped-elsewhere": (
        {"tensor_parallel_axes": ["heads"], "compute_axis_resources": {"kv_heads": "data"}},
        {"batch": DP, "heads": "model", "kv_heads": "data"},
        {"embed": "data", "heads": "model"},
    ),
}
"""name -> (trainer fields, compute mapping, parameter mapping), the mappings as the code before
``trainer.mesh`` resolved them."""


@pytest.mark.parametrize("case", OWN_FIELDS)
def test_the_trainers_own_fields_map_as_they_did(case):
    fields, compute, params = OWN_FIELDS[case]
    config = trainer(**fields)
    assert config.mesh is None  # the config as written: its run id does not change
    assert mappings(config) == (compute, params)


# -- Levanter's spelling --------------------------------------------------------------------


def test_levanter_defaults_split_mlp_and_heads_over_model_and_embed_over_data():
    mesh = MeshConfig()
    assert (mesh.axes, mesh.dcn_axes, mesh.batch_axis_name) == (
        {"data": -1, "replica": 1, "model": 1},
        {"replica_dcn": -1},
        "batch",
    )
    assert mesh.compute_axis_mapping() == {"mlp": "model", "heads": "model", "kv_heads": "model", "batch": DP}
    assert mesh.parameter_axis_mapping() == {"mlp": "model", "heads": "model", "kv_heads": "model", "embed": "data"}
    assert mesh.resolved_sizes(8) == {
        "replica_dcn": 1,
        "replica": 1,
        "data": 8,
        "stage": 1,
        "expert": 1,
        "context": 1,
        "model": 1,
    }
    assert mesh.resolved_sizes(8, num_slices=2) == {
        "replica_dcn": 2,
        "replica": 1,
        "data": 4,
        "stage": 1,
        "expert": 1,
        "context": 1,
        "model": 1,
    }


def test_a_model_axis_is_merged_over_the_default_axes_and_takes_mlp_and_heads():
    config = trainer(mesh={"axes": {"model": 2}})
    assert config.resolved_mesh is config.mesh and config.mesh.axes == {"data": -1, "replica": 1, "model": 2}
    compute, params = mappings(config)
    assert {axis: compute[axis] for axis in ("mlp", "heads", "kv_heads")} == dict.fromkeys(
        ("mlp", "heads", "kv_heads"), "model"
    )
    assert params == {"mlp": "model", "heads": "model", "kv_heads": "model", "embed": "data"}
    assert config.mesh.resolved_sizes(8) == {
        "replica_dcn": 1,
        "replica": 1,
        "data": 4,
        "stage": 1,
        "expert": 1,
        "context": 1,
        "model": 2,
    }
    # -1 given to another axis: data, not set, becomes 1
    assert trainer(mesh={"axes": {"model": -1}}).mesh.resolved_sizes(8)["model"] == 8


def test_param_mapping_and_shared_mapping_as_levanter_resolves_them():
    assert mappings(trainer(mesh={"param_mapping": {"embed": "data"}})) == mappings(trainer(mesh={}))
    assert "embed" not in trainer(mesh={"param_mapping": {}}).parameter_axis_mapping()
    compute, params = mappings(trainer(mesh={"shared_mapping": {"position": "model", "mlp": []}}))
    assert compute == {"heads": "model", "kv_heads": "model", "position": "model", "batch": DP}
    assert params == {"heads": "model", "kv_heads": "model", "position": "model", "embed": "data"}
    compute, _ = mappings(trainer(mesh={"batch_axis_name": "rows", "compute_mapping": {"rows": ["data"]}}))
    assert compute["rows"] == ("data",) and "batch" not in compute
    assert trainer(mesh={"batch_axis_name": "rows"}).batch_axis == "rows"  # what the training step names


def test_an_axis_of_size_one_levanter_core_lacks_is_dropped_with_what_maps_onto_it():
    mesh = MeshConfig(axes={"pipeline": 1}, shared_mapping={"layers": "pipeline", "mlp": ["pipeline", "model"]})
    assert "pipeline" not in mesh.axes
    assert "layers" not in mesh.compute_axis_mapping()
    assert mesh.compute_axis_mapping()["mlp"] == ("model",)


def test_an_expert_axis_splits_the_experts_and_the_batch_as_levanter_writes_it():
    config = trainer(mesh={"axes": {"expert": 4}, "shared_mapping": {"experts": "expert"}})
    compute, param = mappings(config)
    assert compute["experts"] == "expert" and param["experts"] == "expert"
    assert compute["batch"] == ("replica_dcn", "replica", "data", "expert")  # each expert device has its own tokens
    assert config.mesh.resolved_sizes(8) == {
        "replica_dcn": 1,
        "stage": 1,
        "replica": 1,
        "data": 2,
        "expert": 4,
        "context": 1,
        "model": 1,
    }
    # of size 1 (Levanter's default), nothing changes: the batch over the data-parallel axes only
    assert mappings(trainer(mesh={"axes": {"expert": 1}}))[0]["batch"] == ("replica_dcn", "replica", "data")


def test_a_context_axis_splits_the_positions_as_levanter_writes_it():
    config = trainer(mesh={"axes": {"context": 4}, "shared_mapping": {"position": "context"}})
    assert config.mesh.resolved_sizes(8) == {
        "replica_dcn": 1,
        "replica": 1,
        "data": 2,
        "stage": 1,
        "expert": 1,
        "context": 4,
        "model": 1,
    }
    compute, params = mappings(config)
    assert compute["position"] == "context" and compute["batch"] == DP
    assert params["position"] == "context"  # learned position embeddings, where a model has them
    assert config.context_attention == "ring"
    assert trainer(mesh={"axes": {"context": 2}}, context_attention="all_gather").context_attention == "all_gather"


def test_the_same_mesh_either_way():
    pairs = {
        "defaults": ({}, {"mesh": {"shared_mapping": {"mlp": [], "heads": []}}}),
        "tensor-parallel": (
            {"model_axis_size": 2, "tensor_parallel_axes": ["mlp", "heads"]},
            {"mesh": {"axes": {"model": 2}}},
        ),
        "replicas": (
            {"replica_ici_axis_size": 2, "model_axis_size": 2, "fsdp_axis": None},
            {"mesh": {"axes": {"replica": 2, "model": 2}, "dcn_axes": {"replica_dcn": 1}, "shared_mapping": {"mlp": [], "heads": []}, "param_mapping": {}}},
        ),
    }  # fmt: skip
    for name, (own, levanter) in pairs.items():
        a, b = trainer(**own), trainer(**levanter)
        assert mappings(a) == mappings(b), name
        assert a.resolved_mesh.resolved_sizes(8) == b.resolved_mesh.resolved_sizes(8), name
    # and the JAX mesh itself, on 8 simulated devices
    script = (
        "import json, sys\n"
        "from levanter_core.trainer.config import TrainerConfig\n"
        "from levanter_core.trainer.mesh import make_mesh\n"
        "pairs = json.loads(sys.argv[1])\n"
        "print(json.dumps({k: [dict(make_mesh(TrainerConfig.model_validate(c)).shape) for c in v] for k, v in pairs.items()}))\n"
    )
    env = {**os.environ, **simulated_devices(8)}
    result = subprocess.run(
        [sys.executable, "-c", script, json.dumps(pairs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    shapes = json.loads(result.stdout.strip().splitlines()[-1])
    assert shapes["tensor-parallel"][0] == {
        "replica_dcn": 1,
        "replica": 1,
        "data": 4,
        "stage": 1,
        "expert": 1,
        "context": 1,
        "model": 2,
    }
    assert shapes["replicas"][0] == {
        "replica_dcn": 1,
        "replica": 2,
        "data": 2,
        "stage": 1,
        "expert": 1,
        "context": 1,
        "model": 2,
    }
    for name, (own, levanter) in shapes.items():
        assert own == levanter, name


# -- refusals -------------------------------------------------------------------------------


@pytest.fixture
def nano(tmp_path):
    text = open(os.path.join(REPO, "config", "gpt2_nano.yaml")).read()
    path = tmp_path / "nano.yaml"
    path.write_text(text.replace("cache/stdlib/", str(tmp_path / "cache")))
    return str(path)


def load_error(path, *overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load_train_config(path, list(overrides))
    return str(e.value)


def test_an_axis_of_parallelism_not_here_yet_is_refused_by_name(nano):
    message = load_error(nano, "--trainer.mesh", "{axes: {pipeline: 4}}")
    assert "trainer.mesh.axes.pipeline" in message and "pipeline parallelism" in message
    assert "write stage instead" in message  # levanter-core's name for the pipeline's axis
    with pytest.raises(ValidationError, match="not a mesh axis levanter-core has"):
        MeshConfig(dcn_axes={"slices": 2})


def test_sizes_and_mappings_that_cannot_work_are_refused_naming_the_field(nano):
    message = load_error(nano, "--trainer.mesh", "{axes: {model: -1, replica: -1}}")
    assert "trainer.mesh.axes" in message and "replica and model are both -1" in message
    message = load_error(nano, "--trainer.mesh", "{axes: {model: 0}}")
    assert "trainer.mesh.axes.model" in message and "positive number of devices" in message
    message = load_error(nano, "--trainer.mesh", "{shared_mapping: {mlp: modle}}")
    assert "trainer.mesh.shared_mapping.mlp" in message and "'modle'" in message and "replica_dcn" in message
    message = load_error(nano, "--trainer.mesh", "{axes: {replica_dcn: 2}}")
    assert "trainer.mesh.axes.replica_dcn" in message and "not both" in message
    with pytest.raises(ConfigError, match=r"trainer.mesh.axes.model \(3\) does not divide the 8 available device"):
        MeshConfig(axes={"model": 3}).resolved_sizes(8)
    with pytest.raises(ConfigError, match=r"must multiply to 8"):
        MeshConfig(axes={"data": 2, "model": 2}).resolved_sizes(8)


def test_mesh_and_the_trainers_own_fields_together_are_refused(nano):
    message = load_error(nano, "--trainer.mesh", "{axes: {model: 2}}", "--trainer.model_axis_size", "2")
    assert "trainer.mesh" in message and "trainer.model_axis_size" in message and "trainer.mesh.axes.model" in message
    # the defaults of the own fields do not count, nor a batch_axis that says what the mesh says
    config, _ = load_train_config(nano, ["--trainer.mesh", "{batch_axis_name: rows}", "--trainer.batch_axis", "rows"])
    assert config.trainer.batch_axis == "rows"


# -- error messages name the field the config wrote ------------------------------------------


def test_errors_name_the_trainers_own_fields_or_trainer_mesh():
    own = trainer(
        model_axis_size=3, tensor_parallel_axes=["mlp", "heads"], axis_resources={"vocab": "model"}
    ).resolved_mesh
    assert own.field_of("embed") == "trainer.fsdp_axis"
    assert own.field_of("mlp") == "trainer.tensor_parallel_axes"
    assert own.field_of("kv_heads") == "trainer.tensor_parallel_axes (heads, which splits kv_heads)"
    assert own.field_of("vocab") == "trainer.axis_resources.vocab"
    assert own.size_field("model") == "trainer.model_axis_size"
    with pytest.raises(ConfigError, match=r"^trainer.model_axis_size \(3\) does not divide the 8 available device"):
        own.resolved_sizes(8)
    levanter = trainer(mesh={"axes": {"model": 2}, "param_mapping": {"vocab": "data"}}).resolved_mesh
    assert levanter.field_of("vocab") == "trainer.mesh.param_mapping.vocab"
    assert levanter.field_of("mlp").startswith("trainer.mesh.shared_mapping.mlp")
    assert levanter.size_field("model") == "trainer.mesh.axes.model"
    assert levanter.size_field("data").startswith("trainer.mesh.axes.data (-1")
    # what the axis-name check reads: the entries a config wrote, not Levanter's defaults
    assert [(w, axis) for w, axis, _ in levanter.written_entries()] == [("param", "vocab")]


def test_a_stage_axis_splits_the_layers_at_rest_and_while_computing_but_not_the_batch():
    mesh = MeshConfig(axes={"stage": 2})
    assert mesh.resolved_sizes(8) == {
        "replica_dcn": 1, "stage": 2, "replica": 1, "data": 4, "expert": 1, "context": 1, "model": 1,
    }  # fmt: skip
    compute, params = mesh.compute_axis_mapping(), mesh.parameter_axis_mapping()
    assert compute["layers"] == params["layers"] == "stage"
    assert compute["batch"] == ("replica_dcn", "replica", "data")  # every stage sees the whole batch
    assert "layers" not in MeshConfig(axes={"stage": 1}).compute_axis_mapping()
    assert "layers" not in MeshConfig(axes={"stage": 2}, shared_mapping={"layers": []}).compute_axis_mapping()
    assert mesh.field_of("layers", "compute") == "trainer.mesh.axes.stage (which maps layers -> stage)"
