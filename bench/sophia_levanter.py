"""Our Sophia against Levanter's own: 50 steps of ``sophia-h`` and ``sophia-g`` on the same
parameters, gradients, objective and seed, through ``levanter.optim.sophia`` (the package from
PyPI, in a virtual environment of its own) and through ``levanter_optim_contrib.sophia`` (this
environment), and the largest difference of the updates at each step.

Levanter pins versions this project does not use, so it gets its own environment (what
``bench/REFERENCE.md`` describes for the training peer)::

    python3.11 -m venv /tmp/levanter-peer
    /tmp/levanter-peer/bin/pip install levanter==1.2.dev1644 jax==0.7.2 jaxlib==0.7.2 GitPython chex

    .venv/bin/python bench/sophia_levanter.py                   # compare (--peer-python to choose)
    .venv/bin/python bench/sophia_levanter.py --write-golden    # and rewrite the test's golden file

The script runs itself under the peer's Python (``--as-peer``), handing the inputs over and the
updates back in ``.npz`` files. ``--write-golden`` stores Levanter's updates, with the inputs
they were made from, in ``tests/assets/sophia_levanter.npz``, which
``tests/test_sophia_levanter.py`` checks our optimizer against without Levanter installed.

The problem: a two-layer tanh network classifying 16 random points into 4 classes. Its
parameters at each step are a seeded random walk and the gradients are the loss's exact
gradients there (both computed in numpy, so the same on every machine and JAX version); each
optimizer sees them step by step, so a difference at one step does not carry into the inputs
of the next. What the optimizers compute themselves is the Hessian estimate, from the objective
at the step's parameters and their own keys (``rng_seed``): Sophia-H through Levanter's
``stochastic_hessian_diagonal`` (Gaussian ``v``, ``v * (H v)``), Sophia-G through the paper's
Algorithm 2 written as Levanter's unreachable code for it does it (Levanter's
``stochastic_diag_gauss_newton`` raises ``NotImplementedError`` before it, and its ``sophia-g``
config is commented out, so the peer's Sophia-G is Levanter's Sophia transform and config with
that estimator). The configuration is chosen so that the comparison is not all clipped sign
steps: about half the coordinates are unclipped once the estimates have come in.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(REPO, "tests", "assets", "sophia_levanter.npz")
DEFAULT_PEER = os.environ.get("LEVANTER_PEER_PYTHON", "/tmp/levanter-peer/bin/python")

SEED = 0
STEPS = 50
POINTS, FEATURES, HIDDEN, CLASSES = 16, 5, 6, 4
KINDS = ("sophia-h", "sophia-g")
PRECISIONS = ("float32", "float64")

# Field names and meanings are the same in both projects' configs. Not the defaults: a learning
# rate of 1 makes the 1e-6 tolerance a relative one; a shorter interval and a faster average
# give ten estimates that matter within 50 steps; gamma fits the scale of this small problem.
CONFIG = dict(
    learning_rate=1.0,
    warmup=5,
    lr_schedule="cosine",
    min_lr_ratio=0.1,
    weight_decay=0.1,
    default_weight_decay_mask=False,  # decay every parameter, in both
    beta1=0.9,
    beta2=0.8,
    epsilon=1e-12,
    clip_threshold=1.0,
    update_interval=5,
    rng_seed=3,
)
GAMMA = {"sophia-h": 2.0, "sophia-g": 0.5}


# -- the problem (numpy only: the same inputs in every environment) -------------------------------


def problem(seed: int = SEED) -> dict[str, np.ndarray]:
    """The inputs, as flat float64 arrays (int32 for the labels): the data ``x`` and ``y``, and for
    each parameter ``params/<name>`` and ``grads/<name>`` with a leading axis of ``STEPS``."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(POINTS, FEATURES))
    y = rng.integers(0, CLASSES, size=POINTS)
    start = {
        "w1": rng.normal(scale=0.7, size=(FEATURES, HIDDEN)),
        "b1": rng.normal(scale=0.1, size=HIDDEN),
        "w2": rng.normal(scale=0.7, size=(HIDDEN, CLASSES)),
    }
    walk = {k: v + np.cumsum(rng.normal(scale=0.03, size=(STEPS, *v.shape)), axis=0) for k, v in start.items()}
    grads = [_loss_gradient({k: walk[k][t] for k in walk}, x, y) for t in range(STEPS)]
    out = {"x": x, "y": y.astype(np.int32)}
    for k in start:
        out[f"params/{k}"] = walk[k]
        out[f"grads/{k}"] = np.stack([g[k] for g in grads])
    return out


def in_precision(inputs, precision: str) -> dict[str, np.ndarray]:
    """The inputs with their floating-point arrays in ``float32`` or ``float64``."""
    return {k: v.astype(precision) if v.dtype.kind == "f" else v for k, v in inputs.items()}


def _loss_gradient(p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """The gradient of the mean cross-entropy of ``tanh(x w1 + b1) w2``, by hand in float64."""
    hidden = np.tanh(x @ p["w1"] + p["b1"])
    logits = hidden @ p["w2"]
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    dlogits = (probs - np.eye(CLASSES)[y]) / len(y)
    dhidden = (dlogits @ p["w2"].T) * (1 - hidden**2)
    return {"w1": x.T @ dhidden, "b1": dhidden.sum(axis=0), "w2": hidden.T @ dlogits}


def names(inputs) -> list[str]:
    return sorted(k.split("/", 1)[1] for k in inputs if k.startswith("params/"))


def step_tree(inputs, part: str, t: int) -> dict[str, jax.Array]:
    return {k: jnp.asarray(inputs[f"{part}/{k}"][t]) for k in names(inputs)}


# -- the objective, in JAX, for both optimizers -----------------------------------------------------


def logits(params, x):
    return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]


def cross_entropy(out, labels):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(out), labels[:, None], axis=1))


def draw_labels(out, key):
    """Labels drawn from the model's own predictions (Sophia-G's Algorithm 2, step 4)."""
    return jax.random.categorical(key, out)


# -- Levanter's optimizer (run under the peer's Python) --------------------------------------------


def run_levanter(inputs) -> dict[str, np.ndarray]:
    from dataclasses import dataclass

    import equinox as eqx
    from levanter.optim.sophia import BaseSophiaConfig, SophiaHConfig

    x, y = jnp.asarray(inputs["x"]), jnp.asarray(inputs["y"])

    def gauss_newton_bartlett(params, key):
        # Algorithm 2 in the steps Levanter's stochastic_diag_gauss_newton lays out after its
        # `raise NotImplementedError`: the logits and their backward pass, labels drawn from the
        # logits, the loss's gradient against them pulled back to the parameters, B * ghat^2.
        out, backward = eqx.filter_vjp(lambda p: logits(p, x), params)
        labels = draw_labels(out, key)
        (ghat,) = backward(jax.grad(cross_entropy)(out, labels))
        return jax.tree.map(lambda g: g**2 * POINTS, ghat)

    @dataclass(frozen=True)
    class SophiaGConfig(BaseSophiaConfig):
        """Levanter's commented-out ``sophia-g`` config, with the estimator it would call."""

        gamma: float = 0.05

        def compute_hessian(self, fn, model, *batch, hess_key, **batch_kwargs):
            return gauss_newton_bartlett(model, hess_key)

    results = {}
    for kind, config_cls in (("sophia-h", SophiaHConfig), ("sophia-g", SophiaGConfig)):
        optimizer = config_cls(**CONFIG, gamma=GAMMA[kind]).build(STEPS)
        loss = lambda p: cross_entropy(logits(p, x), y)
        step = jax.jit(lambda g, s, p, optimizer=optimizer, loss=loss: optimizer.update(g, s, p, obj_fn=loss))
        results.update(_run(kind, step, optimizer.init(step_tree(inputs, "params", 0)), inputs))
    return results


# -- ours (this environment) -----------------------------------------------------------------------


def ours_config(kind: str):
    from levanter_optim_contrib.sophia import SophiaGConfig, SophiaHConfig

    config_cls = SophiaHConfig if kind == "sophia-h" else SophiaGConfig
    return config_cls(**CONFIG, gamma=GAMMA[kind])


def run_ours(inputs, kinds=KINDS) -> dict[str, np.ndarray]:
    from levanter_core.optim import BatchObjective

    x, y = jnp.asarray(inputs["x"]), jnp.asarray(inputs["y"])

    def sampled_loss(params, key):
        out = logits(params, x)
        return cross_entropy(out, draw_labels(jax.lax.stop_gradient(out), key))

    objective = BatchObjective(
        lambda p, key=None: cross_entropy(logits(p, x), y), sampled_loss, lambda: jnp.float32(POINTS)
    )
    results = {}
    for kind in kinds:
        optimizer = ours_config(kind).build(STEPS)
        step = jax.jit(lambda g, s, p, optimizer=optimizer: optimizer.update(g, s, p, objective=objective))
        results.update(_run(kind, step, optimizer.init(step_tree(inputs, "params", 0)), inputs))
    return results


def _run(kind, step, state, inputs) -> dict[str, np.ndarray]:
    updates = []
    for t in range(STEPS):
        u, state = step(step_tree(inputs, "grads", t), state, step_tree(inputs, "params", t))
        updates.append(jax.device_get(u))
    return {f"{kind}/{k}": np.stack([u[k] for u in updates]) for k in names(inputs)}


def unclipped_fraction(kind: str, inputs, updates) -> np.ndarray:
    """Per step, the fraction of coordinates whose ratio ``m / max(gamma h, eps)`` was inside the
    clipping threshold, read back from the updates ``-lr_t (clip(ratio) + wd x_t)`` (NaN where
    the learning rate is 0 and the update tells nothing)."""
    schedule = ours_config(kind).lr_scheduler(STEPS)
    lr = np.array([float(schedule(t)) for t in range(STEPS)], np.float64)
    inside = np.zeros(STEPS)
    for k in names(inputs):
        u = updates[f"{kind}/{k}"].astype(np.float64)
        p = inputs[f"params/{k}"].astype(np.float64)
        ratio = -u.reshape(STEPS, -1) / np.maximum(lr, 1e-30)[:, None] - CONFIG["weight_decay"] * p.reshape(STEPS, -1)
        inside += (np.abs(ratio) < CONFIG["clip_threshold"] * (1 - 1e-4)).sum(axis=1)
    inside /= sum(inputs[f"params/{k}"][0].size for k in names(inputs))
    return np.where(lr > 0, inside, np.nan)


def step_differences(kind: str, ours, theirs) -> np.ndarray:
    """The largest absolute difference of the updates at each step, over all parameters."""
    keys = [k for k in theirs if k.startswith(kind + "/")]
    return np.max([np.abs(ours[k] - theirs[k]).reshape(STEPS, -1).max(axis=1) for k in keys], axis=0)


# -- driver ----------------------------------------------------------------------------------------


def run_peer(peer_python: str, inputs, precision: str) -> dict[str, np.ndarray]:
    if not os.path.exists(peer_python):
        sys.exit(
            f"no Levanter environment at {peer_python}: create it as this script's docstring says, "
            "or give its Python with --peer-python (or LEVANTER_PEER_PYTHON)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        given, made = os.path.join(tmp, "inputs.npz"), os.path.join(tmp, "updates.npz")
        np.savez(given, **in_precision(inputs, precision))
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH="", JAX_ENABLE_X64=str(int(precision == "float64")))
        subprocess.run([peer_python, os.path.abspath(__file__), "--as-peer", given, made], check=True, env=env)
        with np.load(made) as f:
            return dict(f)


def run_ours_in(precision: str, inputs) -> dict[str, np.ndarray]:
    """Our updates, with JAX's 64-bit mode on for ``float64`` (as the peer runs then)."""
    with jax.enable_x64(precision == "float64"):
        return run_ours(in_precision(inputs, precision))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--peer-python", default=DEFAULT_PEER, help=f"the Levanter environment's python (default {DEFAULT_PEER})"
    )
    parser.add_argument(
        "--write-golden",
        action="store_true",
        help=f"store Levanter's updates and their inputs in {os.path.relpath(GOLDEN, REPO)}",
    )
    parser.add_argument("--as-peer", nargs=2, metavar=("INPUTS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.as_peer:
        with np.load(args.as_peer[0]) as f:
            inputs = dict(f)
        np.savez(args.as_peer[1], **run_levanter(inputs))
        return

    inputs = problem()
    print(f"{STEPS} steps, same parameters, gradients, objective and rng_seed; config {CONFIG}, gamma {GAMMA}")
    golden = {f"inputs/{k}": v for k, v in inputs.items()}
    for precision in PRECISIONS:
        theirs = run_peer(args.peer_python, inputs, precision)
        ours = run_ours_in(precision, inputs)
        golden.update({f"levanter/{precision}/{k}": v for k, v in theirs.items()})
        for kind in KINDS:
            diff = step_differences(kind, ours, theirs)
            inside = unclipped_fraction(kind, inputs, theirs)[CONFIG["update_interval"] :]
            largest = max(np.abs(theirs[k]).max() for k in theirs if k.startswith(kind + "/"))
            print(
                f"\n{kind}, {precision}: max |ours - Levanter| = {diff.max():.3g} over all steps "
                f"(largest update {largest:.3g}; unclipped fraction after step {CONFIG['update_interval']}: "
                f"{inside.min():.2f} to {inside.max():.2f})"
            )
            for row in range(0, STEPS, 10):
                print(f"  steps {row + 1:2d}-{row + 10:2d}: " + " ".join(f"{d:8.1e}" for d in diff[row : row + 10]))
    if args.write_golden:
        os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
        np.savez_compressed(GOLDEN, **golden)
        print(f"\nwrote {os.path.relpath(GOLDEN, REPO)} ({os.path.getsize(GOLDEN) / 1024:.0f} KB)")


if __name__ == "__main__":
    main()
