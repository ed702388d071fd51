"""The registry of strategies every shared test body runs over."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdist as jd

# name -> (factory, devices needed)
REGISTRY = {
    "one_device": (lambda: jd.OneDeviceStrategy(), 1),
    # On jax.make_mesh's default (Explicit) axes, as users build meshes: unannotated steps run with
    # them Auto (test_explicit_meshes and test_sharding_in_types cover FSDP, tensor, context and
    # pipeline axes there).
    "mirrored_2": (lambda: jd.MirroredStrategy(mesh=jax.make_mesh((2,), ("replica",), devices=jax.devices()[:2])), 2),
    "mirrored_8": (lambda: jd.MirroredStrategy(jax.devices()[:8]), 8),
    "sharded_8": (lambda: jd.ShardedStrategy(jax.devices()[:8], min_shard_size=1), 8),
    # FSDP over 4 replicas on a (replica, model) = (4, 2) mesh: variables split on "replica", each
    # replica's two devices holding the same shard (no layout rules here: tensor parallelism is
    # tested in test_sharded)
    "sharded_4x2": (lambda: jd.ShardedStrategy(jax.devices()[:8], min_shard_size=1,
                                               model_parallelism=2), 8),
    "tpu_8": (lambda: jd.TPUStrategy(steps_per_run=4, devices=jax.devices()[:8]), 8),
}


def make(name: str) -> jd.Strategy:
    factory, needed = REGISTRY[name]
    if len(jax.devices()) < needed:
        pytest.skip(f"{name} needs {needed} devices, this backend has {len(jax.devices())}")
    return factory()


# The quick tier (./scripts/test --quick) runs a shared body on one strategy of each kind of layout
# (one device, replicated on 8, FSDP on 8); the full suite adds these, whose layouts those three
# already exercise in part.
QUICK_TIER_LEAVES_OUT = ("mirrored_2", "sharded_4x2", "tpu_8")


def _cases(names):
    return [pytest.param(n, marks=pytest.mark.slow) if n in QUICK_TIER_LEAVES_OUT else n
            for n in names]


all_strategies = pytest.mark.parametrize("strategy_name", _cases(sorted(REGISTRY)))
# For the heaviest end-to-end bodies (compile-bound conv nets): every layout the registry has on the
# full mesh; the one-device and two-device cases add compile time but no layout the eight-device
# ones lack.
full_mesh_strategies = pytest.mark.parametrize(
    "strategy_name", _cases(["mirrored_8", "sharded_4x2", "sharded_8", "tpu_8"]))


def assert_variable_layout(strategy: jd.Strategy, tree, what: str = "state") -> None:
    """Every array of ``tree`` lives on the strategy's devices in the layout the strategy gives
    variables."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    want = jax.tree.leaves(strategy.variable_shardings(shapes))
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    wrong = [
        f"{jax.tree_util.keystr(path)}{leaf.shape}: "
        f"{getattr(leaf.sharding, 'spec', leaf.sharding)} not {sharding.spec}"
        for (path, leaf), sharding in zip(leaves, want, strict=True)
        if leaf.sharding.device_set != set(strategy.devices)
        or not leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    ]
    assert not wrong, (
        f"{what}: {len(wrong)} of {len(leaves)} arrays not in the strategy's variable layout: {wrong}"
    )


def adam(learning_rate: float = 1e-2) -> optax.GradientTransformation:
    """Adam for tests that compare a strategy with one device after several steps: ``eps`` = the
    learning rate.

    Two correct programs sum a gradient in different orders, so they differ by its rounding noise
    (~1e-7 of the summands). Adam's step is ``lr * m / (sqrt(v) + eps)``: where a gradient is ~0 up
    to that noise, the default ``eps=1e-8`` turns the noise into a step of up to ``lr`` in either
    direction, and the comparison says nothing about the strategy. With ``eps >= lr`` a change of
    the gradient moves a parameter by at most that change (as SGD with rate 1 would), while
    gradients well above ``eps`` still take Adam's normalised steps: the math is well-conditioned
    and rtol 1e-5 / atol 1e-6 hold on any machine. (An ``adamw`` with a schedule in such a test
    takes ``eps`` = its peak rate, for the same reason.)
    """
    return optax.adam(learning_rate, eps=learning_rate)


FEATURES, CLASSES, BATCH = 8, 4, 32


def shuffled_batches(epoch: int) -> list:
    """4 fixed ``(x, y)`` batches of ``BATCH`` rows, shuffled per epoch with a seed derived from the
    epoch (deterministic: a resumed run sees the same batches)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * BATCH, FEATURES)).astype(np.float32)
    y = x[:, :CLASSES].argmax(1).astype(np.int32)
    order = np.random.default_rng((1, epoch)).permutation(len(x))
    return [(x[order[i : i + BATCH]], y[order[i : i + BATCH]]) for i in range(0, len(x), BATCH)]


def host_leaves(tree) -> list:
    """Every leaf of ``tree`` as a host numpy array (rng keys as their key data), for bitwise
    comparisons."""

    def one(a):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a = jax.random.key_data(a)
        return np.asarray(jax.device_get(a))

    return [one(a) for a in jax.tree.leaves(tree)]


# ``python -m jaxdist.launch``, run as the file jaxdist/launch.py (``-P``: its folder is not put on
# sys.path): the same launcher, which imports only the standard library, where ``-m`` would first
# import the package jaxdist (jax, flax, orbax: ~2 s of CPU, before any process starts) once per
# job. test_multi_worker keeps one job started through ``-m jaxdist.launch``, and test_job_failures
# its own.
LAUNCH = [sys.executable, "-P", str(Path(__file__).parent.parent / "jaxdist" / "launch.py")]


def launch_env(**extra: str) -> dict:
    """The environment of a ``python -m jaxdist.launch`` child: CPU only, this checkout importable,
    no cluster variables inherited from the test process (the launcher sets its own), plus
    ``extra``."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(Path(__file__).parent.parent),
               **extra)
    for key in ("JAXDIST_COORDINATOR_ADDRESS", "JAXDIST_NUM_PROCESSES", "JAXDIST_PROCESS_ID"):
        env.pop(key, None)
    return env


def load_char_lm(name: str = "char_lm"):
    """``examples/char_lm.py`` imported as module ``name`` (registered in ``sys.modules``: its
    dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(
        name, Path(__file__).parents[1] / "examples" / "char_lm.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
