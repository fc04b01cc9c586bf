"""Our ``sophia-h`` and ``sophia-g`` make the updates Levanter's own Sophia makes.

``tests/assets/sophia_levanter.npz`` holds the updates ``levanter.optim.sophia`` (Levanter
1.2.dev1644 from PyPI, in an environment of its own) made over 50 steps of a small problem:
given parameters and gradients at each step, the Hessian estimates drawn by each optimizer from
the same objective and ``rng_seed``. ``bench/sophia_levanter.py`` describes the problem, runs
the comparison against Levanter again and rewrites the file (``--write-golden``); this test
only runs ours, so it needs neither Levanter nor a network.

In float64 (JAX's 64-bit mode, in which the peer ran too) the two agree to 1e-6 at every step;
what remains (about 1e-7) is the learning-rate schedule, which both compute in float32 by
different formulas. In float32 they agree to a few float32 roundings of the largest update
(about 3e-6 at a learning rate of 1): where the moving average of the Hessian estimates nearly
cancels, dividing by it magnifies the last-bit differences of two JAX versions; our own
float32 run, jitted against op by op, differs by as much.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

import sophia_levanter as bench  # noqa: E402

TOLERANCE = {"float64": 1e-6, "float32": 1e-5}


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    with np.load(bench.GOLDEN) as f:
        return dict(f)


@pytest.fixture(scope="module")
def inputs(golden) -> dict[str, np.ndarray]:
    """The problem regenerated from its seed: the golden file's inputs, so that Levanter's
    updates there answer these very parameters, gradients and data."""
    regenerated = bench.problem()
    stored = {k.removeprefix("inputs/"): v for k, v in golden.items() if k.startswith("inputs/")}
    assert sorted(regenerated) == sorted(stored)
    for k, v in regenerated.items():
        np.testing.assert_allclose(v, stored[k], rtol=1e-10, atol=1e-12, err_msg=f"input {k}")
    return regenerated


@pytest.mark.parametrize("precision", bench.PRECISIONS)
def test_50_steps_of_sophia_h_and_sophia_g_match_levanters_updates(precision, inputs, golden):
    ours = bench.run_ours_in(precision, inputs)
    prefix = f"levanter/{precision}/"
    theirs = {k.removeprefix(prefix): v for k, v in golden.items() if k.startswith(prefix)}
    assert sorted(ours) == sorted(theirs)
    for kind in bench.KINDS:
        differences = bench.step_differences(kind, ours, theirs)
        bad = np.flatnonzero(differences > TOLERANCE[precision])
        assert bad.size == 0, (
            f"{kind}, {precision}: our updates differ from Levanter's by up to {differences.max():.3g} "
            f"(tolerance {TOLERANCE[precision]:g}), first at step {bad[0] + 1} of {bench.STEPS}"
        )


@pytest.mark.parametrize("kind", bench.KINDS)
def test_the_comparison_is_not_only_clipped_sign_steps(kind, inputs, golden):
    """Where every coordinate is clipped, an update is ``lr * sign(m)`` and says nothing about the
    Hessian estimates: after the first estimate, a good part of Levanter's updates are not."""
    theirs = {k.removeprefix("levanter/float64/"): v for k, v in golden.items() if k.startswith("levanter/float64/")}
    inside = bench.unclipped_fraction(kind, inputs, theirs)
    first = bench.CONFIG["update_interval"]
    assert np.nanmax(inside[:first]) == 0  # no estimate yet: Levanter divides by epsilon
    assert inside[first:].mean() > 0.2
