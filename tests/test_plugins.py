"""Plugin discovery, registries, and the failure modes a plugin author can hit."""

import importlib.metadata
import json
import textwrap

import pytest

import levanter_core.plugins as plugins
from conftest import run_cli
from levanter_core.errors import PluginError
from levanter_core.plugins import PluginManager, hookimpl
from levanter_core.tracker import NoopTracker, TrackerConfig


class RecordingTrackerConfig(TrackerConfig):
    note: str = "hi"

    def init(self, run):
        return NoopTracker()


class TrackerPlugin:
    @hookimpl
    def register_trackers(self, register):
        register("recording", RecordingTrackerConfig)


def test_gpt2_plugin_is_found_through_its_installed_entry_point():
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="levanter")}
    assert eps["gpt2"].dist.name == "levanter-model-gpt2"

    entry = PluginManager(autoload=True).registry("model").get("gpt2")
    assert entry.distribution == "levanter-model-gpt2"
    assert entry.config_cls.__name__ == "Gpt2Config"


def test_plugins_command_lists_distributions_versions_and_types():
    result = run_cli("plugins", "--json")
    assert result.returncode == 0, result.stderr
    by_name = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}
    gpt2 = by_name["gpt2"]
    assert gpt2["distribution"] == "levanter-model-gpt2"
    assert gpt2["version"] == importlib.metadata.version("levanter-model-gpt2")
    assert gpt2["types"] == {"model": ["gpt2", "gpt2_hyena"]}
    core = by_name["levanter-core"]
    assert core["error"] is None
    assert "adam" in core["types"]["optimizer"]
    assert {"json", "noop"} <= set(core["types"]["tracker"])

    text = run_cli("plugins")
    assert "levanter-model-gpt2" in text.stdout and "model: gpt2" in text.stdout


def test_in_process_plugin_registers_a_usable_type(fresh_plugins):
    plugins.register_plugin(TrackerPlugin(), name="test-trackers")
    entry = plugins.registry("tracker").get("recording")
    assert entry.config_cls is RecordingTrackerConfig
    assert entry.plugin == "test-trackers"
    assert "gpt2" not in plugins.registry("model")  # autoload is off


def test_duplicate_type_name_is_an_error_naming_both_plugins(fresh_plugins):
    """Using a name two plugins register is the error (tests/test_plugin_clash.py has the rest)."""

    class Again:
        @hookimpl
        def register_trackers(self, register):
            register("recording", RecordingTrackerConfig)

    plugins.register_plugin(TrackerPlugin(), name="first-plugin")
    plugins.register_plugin(Again(), name="second-plugin")
    with pytest.raises(PluginError) as e:
        plugins.registry("tracker").get("recording")
    assert "'recording'" in str(e.value)
    assert "first-plugin" in str(e.value) and "second-plugin" in str(e.value)


def test_duplicate_with_a_builtin_names_the_distribution(fresh_plugins):
    class Shadow:
        @hookimpl
        def register_trackers(self, register):
            register("json", RecordingTrackerConfig)

    plugins.register_plugin(Shadow(), name="shadowing")
    with pytest.raises(PluginError, match=r"levanter-core .*shadowing"):
        plugins.registry("tracker").get("json")


def test_misspelled_hook_is_reported_and_does_not_register(fresh_plugins):
    class Typo:
        @hookimpl
        def register_tracker(self, register):  # missing "s"
            register("typo", RecordingTrackerConfig)

    plugins.register_plugin(Typo(), name="typo-plugin")
    info = fresh_plugins.plugins["typo-plugin"]
    assert "register_tracker" in info.error and "register_trackers" in info.error
    assert "typo" not in plugins.registry("tracker")


def test_registering_a_class_of_the_wrong_kind_is_an_error(fresh_plugins):
    class Wrong:
        @hookimpl
        def register_models(self, register):
            register("not-a-model", RecordingTrackerConfig)

    plugins.register_plugin(Wrong(), name="wrong-kind")
    with pytest.raises(PluginError, match="not a subclass of levanter_core.models.lm.LmConfig"):
        plugins.registry("model")


def test_a_plugin_raising_in_its_hook_is_reported_and_others_still_work(fresh_plugins):
    class Exploding:
        @hookimpl
        def register_trackers(self, register):
            raise RuntimeError("boom")

    plugins.register_plugin(Exploding(), name="exploding")
    plugins.register_plugin(TrackerPlugin(), name="fine")
    assert "recording" in plugins.registry("tracker")
    assert "boom" in fresh_plugins.plugins["exploding"].error


def _fake_distribution(tmp_path, module_body: str, name: str = "broken"):
    """A real installed distribution on a path entry: dist-info with an entry point."""
    (tmp_path / f"{name}_plugin_mod.py").write_text(textwrap.dedent(module_body))
    info = tmp_path / f"levanter_{name}-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: levanter-{name}\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text(f"[levanter]\n{name} = {name}_plugin_mod\n")
    return tmp_path


def test_a_plugin_that_fails_to_import_is_reported_and_others_still_work(tmp_path):
    path = _fake_distribution(tmp_path, "import does_not_exist_anywhere\n")
    result = run_cli("plugins", "--json", env={"PYTHONPATH": str(path)})
    assert result.returncode == 1  # something is broken: say so in the exit status
    by_name = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}
    broken = by_name["broken"]
    assert broken["distribution"] == "levanter-broken" and broken["version"] == "0.3"
    assert "does_not_exist_anywhere" in broken["error"]
    assert by_name["gpt2"]["types"] == {"model": ["gpt2", "gpt2_hyena"]}


def test_autoload_can_be_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv(plugins.AUTOLOAD_ENV, "0")
    assert "gpt2" not in PluginManager().registry("model")
    monkeypatch.setenv(plugins.AUTOLOAD_ENV, "1")
    assert "gpt2" in PluginManager().registry("model")


def test_trace_prints_hook_calls(capsys, monkeypatch):
    monkeypatch.setenv(plugins.TRACE_ENV, "1")
    PluginManager(autoload=False).hook().model_type_for_hf_config(hf_config={"model_type": "x"})
    assert "model_type_for_hf_config" in capsys.readouterr().err


# `levanter plugins`, `levanter configs` and `levanter --help` must stay cheap however many
# plugins are installed: types are registered by import path, so listing them imports no model
# code, no JAX and no Haliax (bench/startup.py times them). A plugin's command module (`.cli`)
# is imported to register its command, and must itself stay light: the JAX check covers it.
_IMPORTS_AFTER = """
import sys
from levanter_core.cli import main
sys.argv = ["levanter", *sys.argv[1:]]
try:
    main()
except SystemExit:
    pass
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "haliax", "equinox", "torch", "transformers")
               or m.startswith("levanter_model_") and not m.endswith((".plugin", ".cli")) and m.count(".") > 0)
print("HEAVY:" + ",".join(heavy), file=sys.stderr)
"""


@pytest.mark.parametrize("args", [["plugins", "--json"], ["configs"], ["--help"]])
def test_listing_plugins_imports_no_model_code_nor_jax(args):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _IMPORTS_AFTER, *args], capture_output=True, text=True, timeout=120)
    heavy = [line for line in out.stderr.splitlines() if line.startswith("HEAVY:")]
    assert heavy == ["HEAVY:"], out.stderr[-2000:]
