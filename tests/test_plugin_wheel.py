"""A model plugin is complete on its own: the wheel of levanter-model-llama, installed beside
only the core's wheel (no other levanter distribution), trains its packaged nano config by
name and passes the tests it ships.

The environment is a fresh virtual environment that sees the third-party packages of the
test environment (JAX, torch, transformers, pytest, ...) through a site directory of links
that leaves out every levanter distribution, so nothing is downloaded."""

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest

from conftest import CLI_IN_PROCESS, REPO

pytest.importorskip("transformers")


def _run(python: str, *args: str, cwd: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([python, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _not_built(top: str):
    """What a copy of the project at ``top`` leaves out: caches, earlier builds and hidden files
    anywhere, and at its top the folders no wheel of it holds (the core's plugins, tests...)."""
    anywhere = shutil.ignore_patterns("*.egg-info", "__pycache__", "build", ".*")
    at_top = {"tests", "docs", "plugins", "examples", "bench", "config", "cache", "logs", "checkpoints"}

    def ignore(directory: str, names: list[str]) -> set[str]:
        return set(anywhere(directory, names)) | (at_top & set(names) if directory == top else set())

    return ignore


def _is_levanters(name: str) -> bool:
    return "levanter" in name.lower().replace("-", "_")


@pytest.fixture(scope="module")
def llama_alone(tmp_path_factory):
    """The python of an environment with the core's and the Llama plugin's wheels only."""
    root = tmp_path_factory.mktemp("wheel-env")
    wheels = root / "wheels"
    # Each project is built from a copy: setuptools builds in the project's own build/ folder,
    # which an earlier build (of the checkout, or an interrupted one) may have left behind.
    sources = []
    for project in (".", os.path.join("plugins", "models-llama")):
        source = root / "src" / (project.replace(os.sep, "-").strip(".") or "core")
        shutil.copytree(os.path.join(REPO, project), source, ignore=_not_built(os.path.join(REPO, project)))
        sources.append(str(source))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "-w", str(wheels), *sources],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]

    # the test environment's packages, less every levanter distribution and editable finder
    ours = sysconfig.get_paths()["purelib"]
    deps = root / "deps"
    deps.mkdir()
    for entry in os.listdir(ours):
        if not _is_levanters(entry):
            os.symlink(os.path.join(ours, entry), deps / entry)

    env = root / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    python = str(env / "bin" / "python")
    site = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=str(root)).stdout.strip()
    # a site directory (so that its .pth files run too) behind the environment's own
    with open(os.path.join(site, "zz_test_deps.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({str(deps)!r})\n")
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target", site,
         *[str(w) for w in sorted(wheels.iterdir())]],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr[-3000:]
    return python, root


LEVANTER = ("-c", "from levanter_core.cli import main; main()")

LISTINGS = (
    CLI_IN_PROCESS
    + r"""
import json, levanter_model_llama

def listing(*args):
    code, out = cli(*args)
    assert code in (0, None), (args, code)
    return json.loads(out)

print(json.dumps({"plugins": listing("plugins", "--json"), "configs": listing("configs", "--json"),
                  "llama_file": levanter_model_llama.__file__}))
"""
)
"""``levanter plugins --json`` and ``levanter configs --json`` through the CLI's entry point, and
where the plugin's package is, in one process (one start of the framework instead of three)."""


@pytest.mark.slow
def test_only_the_core_and_the_plugin_are_installed(llama_alone):
    python, root = llama_alone
    listed = _run(python, "-c", LISTINGS, cwd=str(root))
    assert listed.returncode == 0, listed.stderr
    found = json.loads(listed.stdout.strip().splitlines()[-1])
    plugins = {p["distribution"]: p for p in found["plugins"]["plugins"]}
    assert set(plugins) == {"levanter-core", "levanter-model-llama"}
    assert plugins["levanter-model-llama"]["types"] == {"model": ["llama", "mistral", "phi3"]}
    # the package came from the wheel, not from the repository
    assert not found["llama_file"].startswith(REPO)
    assert {c["name"] for c in found["configs"]} == {"llama_nano", "mistral_nano"}


@pytest.mark.slow
def test_the_packaged_nano_config_trains_by_name(llama_alone, tmp_path):
    python, _ = llama_alone
    trained = _run(
        python, *LEVANTER, "train", "llama_nano", "--no-progress",
        "--trainer.id", "wheel", "--trainer.num_train_steps", "3", "--trainer.steps_per_eval", "3",
        "--trainer.max_eval_batches", "1", "--data.max_files", "20",
        cwd=str(tmp_path),
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "done: step 3" in trained.stdout
    # the config's relative directories are the working directory's
    assert (tmp_path / "checkpoints" / "wheel" / "step-3").is_dir()
    assert (tmp_path / "logs" / "wheel" / "metrics.jsonl").is_file()


SHIPPED = "discovered or refused or llama-gqa or phi3-fused or mistral-no_sliding or legacy_rope"
"""Of the tests the wheel ships, each kind once and each of its three families (the suite runs
every one of them from the source tree): discovery, the 3 refusals, a Hugging Face parity test
of llama, phi3 and mistral, and the 2 legacy rope keys."""


@pytest.mark.slow
def test_the_tests_it_ships_pass(llama_alone, tmp_path):
    python, _ = llama_alone
    ran = _run(
        python, "-m", "pytest", "--pyargs", "levanter_model_llama.tests", "-q", "-x", "-m", "not slow", "-k", SHIPPED,
        "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestUnknownMarkWarning",
        cwd=str(tmp_path), timeout=900,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-2000:]
    passed = re.search(r"(\d+) passed", ran.stdout)
    assert passed and int(passed.group(1)) == 9, ran.stdout[-2000:]
