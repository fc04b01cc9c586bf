"""A type name registered by two distributions (a clash) touches that name alone: every other
type keeps working, ``levanter plugins`` shows it, naming it stops with exit 2 naming both and
how to choose, and a qualified name (``DISTRIBUTION:NAME``) or ``LEVANTER_PLUGINS_PREFER``
chooses. The same for every kind of registry and for the Hugging Face ``model_type`` mapping."""

import json
import textwrap

import pytest

import levanter_core.plugins as plugins
from levanter_core.errors import PluginError
from levanter_core.plugins import KINDS, hookimpl
from levanter_core.plugins.registry import PREFER_ENV
from levanter_core.testing import run_config, write_jsonl

# One real class of each kind, by import path: two plugins register it under the same name.
TARGETS = {
    "model": "levanter_model_gpt2.gpt2:Gpt2Config",
    "data_source": "levanter_core.data.source:UrlSourceConfig",
    "data_format": "levanter_core.data.formats:TextFormat",
    "optimizer": "levanter_core.optim.adam:AdamConfig",
    "tracker": "levanter_core.tracker.base:NoopTrackerConfig",
    "checkpointer": "levanter_core.checkpoint.config:TensorStoreCheckpointerConfig",
    "evaluator": "levanter_eval_harness.config:HarnessConfig",
    "objective": "levanter_core.objective:LmObjective",
}


def test_every_kind_is_covered():
    assert set(TARGETS) == set(KINDS)


def _plugin(hook: str, names: list[str], target: str):
    class Plugin:
        pass

    def register_all(self, register):
        for name in names:
            register(name, target)

    register_all.__name__ = hook
    setattr(Plugin, hook, hookimpl(register_all))
    return Plugin()


@pytest.mark.parametrize("kind", sorted(TARGETS))
def test_a_clash_touches_only_its_name(kind, fresh_plugins, monkeypatch):
    hook, target = KINDS[kind].hook, TARGETS[kind]
    plugins.register_plugin(_plugin(hook, ["clashed", "mine"], target), name="first")
    plugins.register_plugin(_plugin(hook, ["clashed", "theirs"], target), name="second")
    registry = plugins.registry(kind)  # builds: the clash does not break the registry

    assert registry.get("mine").plugin == "first" and registry.get("theirs").plugin == "second"
    assert "clashed" in registry
    with pytest.raises(PluginError) as raised:
        registry.get("clashed")
    message = str(raised.value)
    assert "'first'" in message and "'second'" in message
    assert "first:clashed" in message and "second:clashed" in message and PREFER_ENV in message
    assert KINDS[kind].field in message  # where to write the qualified name

    chosen = registry.get("second:clashed")
    assert chosen.plugin == "second" and chosen.config_cls.__name__ == target.split(":")[1]
    assert {"first:clashed", "second:clashed", "mine", "theirs"} <= set(registry.names())
    assert "clashed" not in registry.names()  # only names that select one type

    monkeypatch.setenv(PREFER_ENV, "other=x, clashed=first")
    assert registry.get("clashed").plugin == "first"


class ShadowJson:
    @hookimpl
    def register_trackers(self, register):
        register("json", "levanter_core.tracker.base:NoopTrackerConfig")


def test_a_clash_with_a_builtin_stops_a_config_that_names_it(fresh_plugins, tmp_path):
    """Config loading: the clashed tracker stops the run (exit status 2, both distributions
    named); the qualified name loads; a config that names neither is untouched."""
    from levanter_model_gpt2 import plugin as gpt2_plugin

    from levanter_core.config.train import load_train_config
    from levanter_core.errors import UserError

    plugins.register_plugin(gpt2_plugin, name="gpt2")
    plugins.register_plugin(ShadowJson(), name="shadowing")
    data = {"train_urls": [write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}])]}

    unrelated = run_config(tmp_path, data, run_id="noop", tracker={"type": "noop"})
    assert load_train_config(unrelated)[0].trainer.tracker[0].type == "noop"

    clashed = run_config(tmp_path, data, run_id="json", tracker={"type": "json"})
    with pytest.raises(UserError) as raised:
        load_train_config(clashed)
    assert raised.value.exit_code == 2
    assert "levanter-core" in str(raised.value) and "shadowing" in str(raised.value)
    assert "levanter-core:json" in str(raised.value)

    config, _ = load_train_config(clashed, ["--trainer.tracker.type", "levanter-core:json"])
    assert type(config.trainer.tracker[0]).__name__ == "JsonTrackerConfig"
    config, _ = load_train_config(clashed, ["--trainer.tracker.type", "shadowing:json"])
    assert type(config.trainer.tracker[0]).__name__ == "NoopTrackerConfig"


# -- an installed third-party distribution ------------------------------------------------------

PHI3_PLUGIN = """
from levanter_core.plugins import hookimpl

@hookimpl
def register_models(register):
    register("phi3", "thirdparty_phi3_config:ThirdPartyPhi3Config")

@hookimpl
def model_type_for_hf_config(hf_config):
    return "phi3" if hf_config.get("model_type") == "phi3" else None
"""

PHI3_CONFIG = """
from levanter_model_llama.phi3 import Phi3Config

class ThirdPartyPhi3Config(Phi3Config):
    '''The third party's phi3.'''
"""


@pytest.fixture
def third_party_phi3(tmp_path, monkeypatch):
    """``levanter-model-phi3``, installed (a dist-info with an entry point on sys.path): its
    own ``phi3`` beside ``levanter-model-llama``'s, and a claim on Hugging Face's ``phi3``."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "thirdparty_phi3_plugin.py").write_text(textwrap.dedent(PHI3_PLUGIN))
    (site / "thirdparty_phi3_config.py").write_text(textwrap.dedent(PHI3_CONFIG))
    info = site / "levanter_model_phi3-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: levanter-model-phi3\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[levanter]\nthirdparty-phi3 = thirdparty_phi3_plugin\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv(plugins.AUTOLOAD_ENV, raising=False)
    plugins.reset(autoload=True)
    yield site
    monkeypatch.undo()
    plugins.reset()


def _levanter(capsys, *args) -> tuple[int, str, str]:
    from levanter_core.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def test_an_installed_clash_is_listed_and_chosen_by_qualified_name(third_party_phi3, tmp_path, capsys):
    code, out, err = _levanter(capsys, "plugins", "--json")
    assert code == 0, err
    listed = json.loads(out)
    by_name = {p["name"]: p for p in listed["plugins"]}
    assert by_name["thirdparty-phi3"]["types"] == {"model": ["phi3"]} and by_name["gpt2"]["error"] is None
    [clash] = listed["clashes"]
    assert (clash["kind"], clash["name"]) == ("model", "phi3")
    assert {r["qualified_name"] for r in clash["registrations"]} == {
        "levanter-model-llama:phi3",
        "levanter-model-phi3:phi3",
    }
    code, out, err = _levanter(capsys, "plugins")
    assert code == 0 and "phi3 (clash)" in out and "clash: model type 'phi3' is registered by" in out

    data = {"train_urls": [write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}])]}
    gpt2 = run_config(tmp_path, data, run_id="gpt2")
    code, out, err = _levanter(capsys, "train", gpt2, "--dry-run")
    assert code == 0, err  # an unrelated model type is untouched

    phi3 = run_config(tmp_path, data, run_id="phi3", model={"type": "phi3", "hidden_dim": 32, "num_heads": 2,
                                                              "num_kv_heads": 2, "intermediate_dim": 64,
                                                              "num_layers": 1, "seq_len": 32})  # fmt: skip
    code, out, err = _levanter(capsys, "train", phi3, "--dry-run")
    assert code == 2, err
    assert "levanter-model-llama" in err and "levanter-model-phi3 1.0" in err and "Traceback" not in err
    assert "levanter-model-phi3:phi3" in err and "model.type" in err

    code, out, err = _levanter(capsys, "train", phi3, "--dry-run", "--model.type", "levanter-model-phi3:phi3")
    assert code == 0, err
    assert "type: levanter-model-phi3:phi3" in out
    from levanter_core.config.base import validate_section

    assert type(validate_section("model", {"type": "levanter-model-phi3:phi3"})).__name__ == "ThirdPartyPhi3Config"
    assert type(validate_section("model", {"type": "levanter-model-llama:phi3"})).__name__ == "Phi3Config"


def test_a_clashed_hugging_face_model_type_names_both_and_a_setting_chooses(third_party_phi3, monkeypatch):
    from levanter_model_llama.phi3 import Phi3Config

    from levanter_core.hf.bridge import config_from_hf

    hf_config = Phi3Config(hidden_dim=32, num_heads=2, num_kv_heads=2, intermediate_dim=64, num_layers=1).to_hf_config(
        100
    )
    with pytest.raises(PluginError) as raised:
        config_from_hf(hf_config)
    message = str(raised.value)
    assert "levanter-model-llama" in message and "levanter-model-phi3" in message
    assert f"{PREFER_ENV}=phi3=" in message

    monkeypatch.setenv(PREFER_ENV, "phi3=levanter-model-phi3")
    ours = config_from_hf(hf_config)
    # recorded qualified, so that an import's saved config selects the same type again
    assert type(ours).__name__ == "ThirdPartyPhi3Config" and ours.type == "levanter-model-phi3:phi3"
    monkeypatch.setenv(PREFER_ENV, "phi3=levanter-model-llama")
    ours = config_from_hf(hf_config)
    assert type(ours) is Phi3Config and ours.type == "levanter-model-llama:phi3"
    # a Hugging Face config nobody else claims is untouched
    assert config_from_hf({**hf_config, "model_type": "llama"}).type == "llama"
