"""The tests every model family runs, written once: a family's test class states its cases
as class attributes and inherits the tests (in the spirit of ``transformers``'
``ModelTesterMixin``).

::

    class TestLlama(ModelFamilyTests)         one class per plugin, in its tests/
      hf_configs = {name: () -> HF config}    ─┬─> test_matches_hugging_face[name]
      unrolled = (name, ...)                   ├─> test_unrolled_layers_match_hugging_face[name]
      generation = (name, ...)                 └─> test_greedy_decoding_matches_transformers_generate[name]
      refused = {message: () -> HF dict}      ───> test_unsupported_settings_are_refused_by_name[message]
      package, nano_configs = (file, ...)     ─┬─> test_nano_config_trains[file]       (slow)
      golden_losses = "assets/losses"          └─> ... and its 20-step loss curve, step by step
      distribution, types                     ───> test_discovered_through_its_entry_point

:class:`ModelFamilyTests` is the four kinds together; a plugin that has only some of them
inherits the parts (:class:`HfParityTests`, :class:`RefusalTests`, :class:`NanoTrainingTests`,
:class:`DiscoveryTests`). A test class's name must begin with ``Test`` for pytest to collect
it; these mixins' names do not, so they are never collected on their own. What only one
family checks stays a plain test in its own file, or extends a hook here
(:meth:`NanoTrainingTests.check_nano_run`) so that it shares the work already done.

The parity tests need ``torch`` and ``transformers`` (test-only dependencies): a family's test
module calls ``pytest.importorskip`` for both before it builds a ``transformers`` config. They
run ``torch`` on one thread (:func:`one_torch_thread`): its models are tiny, and a second
thread only waits, spinning, for work to share (the tests run beside others, often on few
cores): on two threads Qwen's tests without the nano runs took 105 CPU-seconds, on one 55.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import re
from collections.abc import Callable, Iterator
from importlib import resources
from typing import Any, ClassVar

import pytest

from levanter_core.errors import CheckpointError
from levanter_core.hf.bridge import config_from_hf
from levanter_core.hf.parity import check_generation_parity, check_hf_parity
from levanter_core.testing import golden, listed_plugin, train_briefly
from levanter_core.testing.metrics import logged

HfConfigFactory = Callable[[], Any]
"""Builds a ``transformers`` config object: a function, so that nothing is built at import."""


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run ``torch`` (when installed) on one thread inside the block, as many as it had after.
    Its operations on a tiny model are too small to share: with more threads, each operation
    leaves the others spinning while they wait for the next one (measured: ``generate`` of 3
    x 48 tokens of a tiny Qwen3-MoE took 8.5 CPU-seconds on two threads and 1.0 on one).
    The results do not depend on it beyond float rounding."""
    try:
        import torch
    except ImportError:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class _Parametrized:
    """Parametrizes an inherited test by a class attribute: a test method's argument named in
    the :attr:`case_lists` of any class it inherits runs once per entry of the attribute named
    there (an empty one gives pytest's skip, "got empty parameter set")."""

    case_lists: ClassVar[dict[str, str]] = {}
    """Test argument -> the name of the class attribute that lists its cases (each mixin
    declares its own; they are merged over the class's bases)."""

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """pytest's hook, called on the collected class for each of its test methods."""
        case_lists: dict[str, str] = {}
        for klass in reversed(type(self).__mro__):
            case_lists.update(vars(klass).get("case_lists", {}))
        for argument, attribute in case_lists.items():
            if argument in metafunc.fixturenames:
                metafunc.parametrize(argument, list(getattr(self, attribute)))


class HfParityTests(_Parametrized):
    """Logits and config against ``transformers``, through ``import-hf`` and ``export-hf``
    (:func:`~levanter_core.hf.parity.check_hf_parity`), with the layers stacked and unrolled,
    and greedy decoding against ``transformers``' ``generate``."""

    case_lists = {"hf_case": "hf_configs", "unrolled_case": "unrolled", "generation_case": "generation"}

    hf_configs: ClassVar[dict[str, HfConfigFactory]] = {}
    """Case name -> a function that returns the tiny ``transformers`` config of that variant."""
    unrolled: ClassVar[tuple[str, ...]] = ()
    """Cases of :attr:`hf_configs` checked again with ``scan_layers: false`` (hnn.BlockSeq)."""
    generation: ClassVar[tuple[str, ...]] = ()
    """Cases of :attr:`hf_configs` whose greedy decoding is compared with ``generate``'s."""
    without_special_tokens: ClassVar[frozenset[str]] = frozenset()
    """Cases whose translated config carries no special token ids (the export's comparison
    still checks them): families whose ``transformers`` defaults lie outside a tiny vocabulary."""
    parity_tolerance: ClassVar[float] = 1e-4
    """The largest absolute logit difference allowed after import and after export."""
    parity_seq_len: ClassVar[int] = 24
    """Positions compared: longer than the sliding windows (8) and original context lengths
    (16) of the tiny variants, so that windows and scaled rotations take effect."""

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """Also refuses, at collection, an unrolled or generation case that names no variant."""
        for attribute in ("unrolled", "generation"):
            unknown = sorted(set(getattr(self, attribute)) - set(self.hf_configs))
            if unknown:
                raise ValueError(f"{type(self).__name__}.{attribute} names {unknown}, not in hf_configs")
        super().pytest_generate_tests(metafunc)

    @pytest.fixture(autouse=True)
    def _one_torch_thread(self) -> Iterator[None]:
        """Every test of the class runs ``torch`` on one thread (:func:`one_torch_thread`)."""
        with one_torch_thread():
            yield

    def check_parity(self, case: str, workdir: str, *, scan_layers: bool) -> None:
        """Import, compare, export, reload and compare ``case``; the config unchanged by the
        round trip; the export written in more than one shard."""
        report = check_hf_parity(self.hf_configs[case](), workdir, seq_len=self.parity_seq_len, scan_layers=scan_layers)
        report.assert_matches(self.parity_tolerance, special_tokens=case not in self.without_special_tokens)
        assert report.shards > 1, "the tiny export should need several 64 KiB shards"

    def test_matches_hugging_face(self, hf_case: str, tmp_path) -> None:
        self.check_parity(hf_case, str(tmp_path), scan_layers=True)

    def test_unrolled_layers_match_hugging_face(self, unrolled_case: str, tmp_path) -> None:
        self.check_parity(unrolled_case, str(tmp_path), scan_layers=False)

    def test_greedy_decoding_matches_transformers_generate(self, generation_case: str, tmp_path) -> None:
        # three prompts of different lengths in one batch of the engine's key/value cache
        check_generation_parity(self.hf_configs[generation_case](), str(tmp_path)).assert_matches()


class RefusalTests(_Parametrized):
    """Settings a family cannot honour are refused at import, by name, as a ``CheckpointError``."""

    case_lists = {"refused_case": "refused"}

    refused: ClassVar[dict[str, Callable[[], dict]]] = {}
    """The message expected (a literal part of it) -> a function that returns the Hugging Face
    config, as the dict a ``config.json`` holds, that must be refused with it."""

    def test_unsupported_settings_are_refused_by_name(self, refused_case: str) -> None:
        with pytest.raises(CheckpointError, match=re.escape(refused_case)):
            config_from_hf(self.refused[refused_case]())


class NanoTrainingTests(_Parametrized):
    """Each nano config the plugin ships trains a few steps (``slow``); with
    :attr:`golden_losses`, twenty, and its loss curve is compared with the one recorded
    (:mod:`~levanter_core.testing.golden`)."""

    case_lists = {"nano_config": "nano_configs"}

    package: ClassVar[str] = ""
    """The plugin's import package; its nano configs are in the ``configs`` folder inside it."""
    nano_configs: ClassVar[tuple[str, ...]] = ()
    """File names of the nano configs to train."""
    nano_overrides: ClassVar[tuple[str, ...]] = ()
    """Command-line overrides for every nano run (``"--trainer.train_batch_size", "4"``)."""
    nano_steps: ClassVar[int] = 4
    """Steps of a nano run without :attr:`golden_losses` (with it: ``golden.GOLDEN_STEPS``)."""
    golden_losses: ClassVar[str | None] = None
    """The folder of this family's golden loss curves, relative to that of the test module
    that defines the class (``"assets/losses"``), one ``<config name>.json`` per nano config.
    Set, each nano run is a golden run (:func:`~levanter_core.testing.golden.train_golden`:
    ``GOLDEN_STEPS`` steps of a small batch on a corpus the test writes, the config's model
    and optimizer unchanged), checked as any nano run and then against its curve; a missing
    curve skips the test, saying how to record it (``LEVANTER_UPDATE_GOLDEN=1``). None: the
    run of :attr:`nano_steps` steps on the standard library, no curve."""

    @property
    def nano_run_steps(self) -> int:
        """Steps of each nano run: ``golden.GOLDEN_STEPS`` with :attr:`golden_losses`, else
        :attr:`nano_steps`."""
        return golden.GOLDEN_STEPS if self.golden_losses else self.nano_steps

    def nano_config_path(self, name: str) -> str:
        """The path of nano config ``name`` in the installed package."""
        return str(resources.files(self.package) / "configs" / name)

    def golden_path(self, name: str) -> str:
        """Where the golden loss curve of nano config ``name`` is kept (see :attr:`golden_losses`)."""
        folder = os.path.join(os.path.dirname(inspect.getfile(type(self))), self.golden_losses or "")
        return os.path.join(folder, os.path.splitext(name)[0] + ".json")

    def golden_data(self, workdir: str) -> list[str]:
        """The ``data`` overrides of a golden run, its corpus written under ``workdir``: by
        default :func:`~levanter_core.testing.golden.golden_corpus` (text). A family whose
        configs read other data (speech) writes its own here."""
        return golden.golden_corpus(os.path.join(workdir, "corpus"))

    @pytest.mark.slow
    def test_nano_config_trains(self, nano_config: str, tmp_path) -> None:
        path, workdir = self.nano_config_path(nano_config), str(tmp_path)
        if not self.golden_losses:
            result = train_briefly(path, workdir, steps=self.nano_steps, overrides=self.nano_overrides)
            self.check_nano_run(nano_config, result)
            return
        data = self.golden_data(workdir)
        result = golden.train_golden(path, workdir, data=data, overrides=self.nano_overrides)
        self.check_nano_run(nano_config, result)
        golden.check_golden_losses(
            self.golden_path(nano_config),
            nano_config,
            logged(result.run_dir, "train/loss", once=True),
            golden.recorded_overrides(workdir, data, self.nano_overrides),
        )

    def check_nano_run(self, nano_config: str, result) -> None:
        """What every nano run must show: each step trained and logged once with a finite loss,
        and the evaluation loss lower at the end than at the start. A family extends this (and
        calls it) to check more of the same run."""
        steps = list(range(1, self.nano_run_steps + 1))
        assert result.final_step == self.nano_run_steps
        losses = logged(result.run_dir, "train/loss", once=True)
        assert sorted(losses) == steps, f"{nano_config}: train/loss logged at steps {sorted(losses)}"
        assert all(math.isfinite(loss) for loss in losses.values()), f"{nano_config}: losses {losses}"
        assert result.final_eval_loss < result.initial_eval_loss, nano_config


class DiscoveryTests:
    """``levanter plugins`` finds the distribution through its entry point, without an error,
    with the types and hooks it registers (any kind of plugin, not only a model family)."""

    distribution: ClassVar[str] = ""
    """The distribution's name, as ``pip`` knows it (``levanter-model-llama``)."""
    types: ClassVar[dict[str, list[str]]] = {}
    """What it registers, as ``levanter plugins --json`` lists it: kind -> names, in order
    (``{"model": ["llama", "mistral", "phi3"]}``)."""
    hooks: ClassVar[frozenset[str]] = frozenset({"register_models", "model_type_for_hf_config"})
    """The hooks it implements (a model family's two by default)."""

    def test_discovered_through_its_entry_point(self) -> None:
        ours = listed_plugin(self.distribution)
        assert ours["error"] is None, ours["error"]
        assert ours["types"] == self.types
        assert set(ours["hooks"]) == set(self.hooks)


class ModelFamilyTests(HfParityTests, RefusalTests, NanoTrainingTests, DiscoveryTests):
    """All the tests a decoder family inherits: parity with ``transformers`` (stacked, unrolled,
    greedy decoding), refusals by name, its nano configs' training, and discovery."""
