"""strategy.run's mirrored outputs are proven, failing closed, and the proof is checked on device.

What the analysis trusts is pinned against the installed JAX; what it does not know (a primitive
defined here, a host callback with effects) comes back per replica; right programs that pmap-era and
tf.distribute code writes come back mirrored; values fed back without the all-reduce are refused
whatever their shape; and an analysis made wrong on purpose is caught on device at the first call.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore
from jax.interpreters import mlir

import jaxdist as jd
from jaxdist.strategies.compile import _identical, _run
from jaxdist.strategies.compile._identical import CALLS, IDENTICAL, PURE, REDUCING, SPREADING

N = 8


def _primitive_names() -> set[str]:
    """Every primitive the installed JAX defines (its modules walked; kernels' languages left
    out)."""
    import jax._src as src

    for info in pkgutil.walk_packages(src.__path__, "jax._src."):
        if not any(part in info.name for part in ("pallas", "mosaic", "triton", "test", "cudnn",
                                                  "tpu", "cloud")):
            with contextlib.suppress(Exception):  # a module that needs what is not installed here
                importlib.import_module(info.name)
    found = set()
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("jax"):
            found |= {v.name for v in vars(module).values() if isinstance(v, jcore.Primitive)}
    return found


def test_every_trusted_primitive_name_is_one_the_installed_jax_defines():
    """A JAX upgrade that renames a primitive fails here, not in a user's program (the renamed one
    would only be refused: unknown primitives are never trusted)."""
    trusted = PURE | REDUCING | SPREADING | CALLS | {"cond", "scan", "while", "axis_index"}
    missing = sorted(trusted - _primitive_names())
    assert not missing, f"trusted primitive names the installed JAX does not define: {missing}"


def _new_primitive() -> jcore.Primitive:
    prim = jcore.Primitive("jaxdist_test_unknown")
    prim.def_impl(lambda x: x + 1)
    # JAX types its result invariant
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(prim, mlir.lower_fun(lambda x: x + 1, multiple_results=False))
    return prim


_UNKNOWN = _new_primitive()


@pytest.mark.parametrize("check_vma", [None, True, False])
def test_a_primitive_the_analysis_does_not_know_comes_back_per_replica(check_vma):
    """JAX's own typing calls this primitive's result invariant whatever its input (it fails open):
    run does not take its word, or the analysis's default. The values are still right."""
    strategy = jd.MirroredStrategy()
    w = strategy.mirror(jnp.arange(3.0))
    x = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
    of_mirrored, of_batch = strategy.run(lambda w, x: (_UNKNOWN.bind(w), _UNKNOWN.bind(x)),
                                         args=(w, x), batch_argnums=(1,), check_vma=check_vma)
    assert isinstance(of_mirrored, jd.PerReplica) and isinstance(of_batch, jd.PerReplica)
    for i, (a, b) in enumerate(zip(strategy.experimental_local_results(of_mirrored),
                                   strategy.experimental_local_results(of_batch), strict=True)):
        np.testing.assert_array_equal(a, np.arange(3.0) + 1)
        np.testing.assert_array_equal(b, x[i:i + 1] + 1)


def test_a_host_callback_with_effects_comes_back_per_replica_a_pure_one_mirrored():
    strategy = jd.MirroredStrategy()
    w = strategy.mirror(jnp.ones(2))
    shape = jax.ShapeDtypeStruct((2,), jnp.float32)

    def fn(w):
        effect = jax.experimental.io_callback(lambda a: np.asarray(a) * 2, shape, w)
        pure = jax.pure_callback(lambda a: np.asarray(a) * 3, shape, w)  # pure by JAX's contract
        return effect, w - 0.1 * pure

    effect, updated = strategy.run(fn, args=(w,))
    assert isinstance(effect, jd.PerReplica)
    assert isinstance(updated, jax.Array) and updated.sharding.is_fully_replicated
    np.testing.assert_allclose(updated, [0.7, 0.7], rtol=1e-6)


def test_the_analysis_made_wrong_on_purpose_is_caught_on_device(monkeypatch):
    """The proof is checked where it is cheap: at the first call, each device fingerprints what it
    would return mirrored, and the fingerprints are compared on device."""
    strategy = jd.MirroredStrategy()
    # says all is identical
    monkeypatch.setattr(_run, "program_values", lambda program, axes: [IDENTICAL] * 8)

    def drifting(w, x):
        return w - 0.1 * x.sum(0)  # a local update: differs per replica

    w, x = strategy.mirror(jnp.ones(3)), np.arange(N * 3, dtype=np.float32).reshape(N, 3)
    with pytest.raises(RuntimeError,
                       match=r"strategy.run\(.*drifting\): output .*differen.*all_reduce"):
        strategy.run(drifting, args=(w, x), batch_argnums=(1,))


def test_the_first_call_is_checked_and_every_call_on_request(monkeypatch):
    strategy = jd.MirroredStrategy()
    monkeypatch.setattr(_run, "program_values", lambda program, axes: [IDENTICAL] * 8)

    def scaled(w, x, scale):
        return w + scale * x.sum(0)  # the same on every replica only while scale is 0

    w, x = strategy.mirror(jnp.ones(3)), np.arange(N * 3, dtype=np.float32).reshape(N, 3)
    zero, one = strategy.mirror(jnp.float32(0.0)), strategy.mirror(jnp.float32(1.0))
    strategy.run(scaled, args=(w, x, zero), batch_argnums=(1,))  # checked: the copies agree
    # not checked again: the analysis is trusted
    strategy.run(scaled, args=(w, x, one), batch_argnums=(1,))
    monkeypatch.setenv("JAXDIST_CHECK_MIRRORED", "every")
    with pytest.raises(RuntimeError, match=r"output .*all_reduce"):
        strategy.run(scaled, args=(w, x, one), batch_argnums=(1,))
    monkeypatch.setenv("JAXDIST_CHECK_MIRRORED", "sometimes")
    with pytest.raises(ValueError, match=r"JAXDIST_CHECK_MIRRORED='sometimes'.*'first'.*'every'"):
        strategy.run(scaled, args=(w, x, one), batch_argnums=(1,))
    monkeypatch.delenv("JAXDIST_CHECK_MIRRORED")
    with pytest.raises(RuntimeError, match=r"output .*all_reduce"):  # the argument, as the variable
        strategy.run(scaled, args=(w, x, one), batch_argnums=(1,), check_mirrored="every")
    with pytest.raises(ValueError, match=r"check_mirrored='always'.*'first'.*'every'"):
        strategy.run(scaled, args=(w, x, one), batch_argnums=(1,), check_mirrored="always")


@pytest.mark.parametrize("body, want", [
    (lambda w, x: x * np.arange(3.0), lambda w, x: x * np.arange(3.0)),
    (lambda w, x: w.at[0].set(5.0).at[1].add(2.0), lambda w, x: np.array([5.0, 3.0, 1.0])),
    (lambda w, x: jnp.take(w, np.array([2, 0])), lambda w, x: np.array([1.0, 1.0])),
    (lambda w, x: w * jnp.float32(2.0), lambda w, x: np.full(3, 2.0)),
    (lambda w, x: w + np.ones(3, np.float32) * jnp.sum(np.arange(4.0)), lambda w, x: np.full(3, 7.0)),
], ids=["constant-times-batch", "at-updates", "take-numpy-index", "scalar-constant",
        "constant-reduced"])
def test_constants_the_function_closes_over_run(body, want):
    """The replica program has more inputs than the arguments (the constants): no internal error,
    and a value computed from mirrored arguments and constants alone is mirrored."""
    strategy = jd.MirroredStrategy()
    w, x = jnp.ones(3), np.arange(N * 3, dtype=np.float32).reshape(N, 3)
    got = strategy.run(body, args=(strategy.mirror(w), x), batch_argnums=(1,))
    if isinstance(got, jd.PerReplica):
        np.testing.assert_allclose(np.concatenate(strategy.experimental_local_results(got)),
                                   want(w, x))
    else:
        assert got.sharding.is_fully_replicated
        np.testing.assert_allclose(got, want(w, x))


def _loss(w, x):
    return jnp.mean((jnp.tanh(x @ w) - 1.0) ** 2)


def test_pmap_era_grad_of_a_pmean_loss_equals_jax_pmap():
    """pmap's psum transposes to a psum: ``grad`` of a ``pmean`` loss, then ``pmean`` of the
    gradient, is the global gradient there. Run with ``axis_name=`` (pmap-era code) computes the
    same, bit for bit."""
    strategy = jd.MirroredStrategy()
    rng = np.random.default_rng(0)
    w, x = (rng.normal(size=(4, 2)).astype(np.float32),
            rng.normal(size=(N * 2, 4)).astype(np.float32))

    def step(w, x):
        g = jax.lax.pmean(jax.grad(lambda w: jax.lax.pmean(_loss(w, x), "batch"))(w), "batch")
        return w - 0.5 * g

    got = strategy.run(step, args=(strategy.mirror(w), x), batch_argnums=(1,), axis_name="batch")
    want = jax.pmap(step, axis_name="batch")(np.stack([w] * N), x.reshape(N, 2, 4))
    assert isinstance(got, jax.Array) and got.sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want[0]))
    one_device = w - 0.5 * jax.grad(_loss)(w, x)
    np.testing.assert_allclose(np.asarray(got), one_device, rtol=1e-5, atol=1e-6)


def test_nested_sums_over_every_batch_axis_are_mirrored():
    """psum over 'data', then over 'fsdp', spans every replica axis as one psum over both does."""
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    strategy = jd.ShardedStrategy(mesh=mesh, batch_axes=("data", "fsdp"))
    w, x = np.ones(3, np.float32), np.arange(N * 3, dtype=np.float32).reshape(N, 3)

    def step(w, x):
        g = x.sum(0)
        nested = jax.lax.psum(jax.lax.psum(g, "data"), "fsdp") / 8
        partial = jax.lax.psum(g, "data")  # over part of the replica axes: still differs
        return w - 0.1 * nested, partial

    good, bad = strategy.run(step, args=(strategy.mirror(w), x), batch_argnums=(1,))
    assert isinstance(good, jax.Array) and good.sharding.is_fully_replicated
    np.testing.assert_allclose(good, w - 0.1 * x.sum(0) / 8, rtol=1e-6)
    assert isinstance(bad, jd.PerReplica)


def test_a_replica_id_test_true_on_every_replica_is_a_constant():
    strategy = jd.MirroredStrategy()

    def step(w, x):
        ctx = jd.get_replica_context()
        g = ctx.all_reduce(jd.ReduceOp.MEAN, x.sum(0))
        every = jnp.where(ctx.replica_id_in_sync_group >= 0, 1.0, 0.0)  # true on every replica
        first = jnp.where(ctx.replica_id_in_sync_group == 0, 1.0, 0.0)  # true on one
        return w - 0.1 * g * every, g * first

    w, x = np.ones(3, np.float32), np.arange(N * 3, dtype=np.float32).reshape(N, 3)
    every, first = strategy.run(step, args=(strategy.mirror(w), x), batch_argnums=(1,))
    assert isinstance(every, jax.Array) and every.sharding.is_fully_replicated
    assert isinstance(first, jd.PerReplica)


def test_a_loop_whose_trip_count_differs_comes_back_per_replica():
    strategy = jd.MirroredStrategy()

    def step(w):
        n = jax.lax.axis_index("replica") + 1
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] * 2.0),
                                  (0, jnp.ones(2)))[1] * w

    got = strategy.run(step, args=(strategy.mirror(jnp.ones(2)),))
    assert isinstance(got, jd.PerReplica)
    np.testing.assert_allclose(np.stack(strategy.experimental_local_results(got)),
                               [[2.0 ** (i + 1)] * 2 for i in range(N)])


def _local_step(w, x):
    return w - 0.1 * jax.grad(_loss)(w, x)  # no all-reduce: each replica's copy drifts


@pytest.mark.parametrize("wrap, unwrap", [
    (lambda w: w, lambda out: out),
    (lambda w: {"a": [{"b": w}]}, lambda out: out),
], ids=["lone-array", "nested-three-deep"])
def test_a_variable_updated_without_the_all_reduce_is_refused_whatever_its_shape(wrap, unwrap):
    strategy = jd.MirroredStrategy()
    w, x = (np.ones((4, 2), np.float32),
            np.random.default_rng(1).normal(size=(N * 2, 4)).astype(np.float32))

    def step(state, x):
        return jax.tree.map(lambda w: _local_step(w, x), state)

    with pytest.raises(ValueError,
                       match=r"takes the place of the mirrored argument args\[0\].*all_reduce"):
        strategy.run(step, args=(strategy.mirror(wrap(w)), x), batch_argnums=(1,))


def test_a_variable_updated_without_the_all_reduce_and_cast_is_refused():
    strategy = jd.MirroredStrategy()
    w, x = (np.ones((4, 2), np.float32),
            np.random.default_rng(1).normal(size=(N * 2, 4)).astype(np.float32))
    with pytest.raises(ValueError,
                       match=r"output takes the place of the mirrored argument args\[0\]"):
        strategy.run(lambda w, x: _local_step(w, x).astype(jnp.bfloat16),
                     args=(strategy.mirror(w), x), batch_argnums=(1,))


def test_a_variable_updated_locally_in_a_loop_is_refused():
    strategy = jd.MirroredStrategy()
    w, x = (np.ones((4, 2), np.float32),
            np.random.default_rng(1).normal(size=(N * 2, 4)).astype(np.float32))

    def step(w, x):
        return jax.lax.fori_loop(0, 2, lambda i, w: _local_step(w, x), w)

    with pytest.raises(ValueError,
                       match=r"output takes the place of the mirrored argument args\[0\]"):
        strategy.run(step, args=(strategy.mirror(w), x), batch_argnums=(1,))


def test_per_replica_gradients_with_a_weight_decay_term_are_not_an_update():
    """A gradient is computed in the backward pass, even its ``wd * w`` term: returned for a
    cross-replica reduce, it is a per-replica value, not a variable that drifted."""
    strategy = jd.MirroredStrategy()
    w, x = (np.ones((4, 2), np.float32),
            np.random.default_rng(1).normal(size=(N * 2, 4)).astype(np.float32))

    def grads(w, x):
        return jax.grad(lambda w: _loss(w, x) + 0.01 * jnp.sum(w ** 2))(w)

    got = strategy.run(grads, args=(strategy.mirror(w), x), batch_argnums=(1,))
    assert isinstance(got, jd.PerReplica)
    want = jax.grad(lambda w: _loss(w, x) + 0.01 * jnp.sum(w ** 2))(w)
    np.testing.assert_allclose(strategy.reduce(jd.ReduceOp.MEAN, got), want, rtol=1e-5, atol=1e-6)


def test_the_analysis_reads_inputs_it_was_not_given_as_different():
    """A jaxpr with more inputs than facts given: nothing is proven (no internal error)."""
    jaxpr = jax.make_jaxpr(lambda a, b: (a * 2, b))(jnp.ones(2), jnp.ones(2))
    assert _identical.output_values(jaxpr, [False], ["replica"]) == ["different", "different"]


def test_inside_a_compiled_step_the_check_runs_on_request(monkeypatch):
    """A run inside strategy.jit is part of the step's program: the check is then a host callback of
    the step, added with JAXDIST_CHECK_MIRRORED=every (it would otherwise cost every call of the
    step)."""
    strategy = jd.MirroredStrategy()
    monkeypatch.setattr(_run, "program_values", lambda program, axes: [IDENTICAL] * 8)

    def replica_step(w, x):
        return w - 0.1 * x.sum(0)

    step = strategy.jit(lambda w, x: strategy.run(replica_step, args=(w, x)), batch_argnums=(1,))
    w, x = strategy.mirror(jnp.ones(3)), np.arange(N * 3, dtype=np.float32).reshape(N, 3)
    monkeypatch.setenv("JAXDIST_CHECK_MIRRORED", "every")
    with pytest.raises(Exception, match=r"replica_step\): output .*all_reduce"):
        jax.block_until_ready(step(w, x))


def test_a_collective_in_a_loop_some_replicas_may_leave_early_is_named_before_it_runs():
    """Replicas that loop a different number of times with a psum inside would wait for each other
    forever (XLA aborts after a rendezvous timeout): a ValueError before anything runs. The same
    loop with its condition combined across replicas runs."""
    strategy = jd.MirroredStrategy()
    x = np.arange(N * 2, dtype=np.float32).reshape(N, 2)

    def local_condition(x):
        def body(c):
            return c[0] + 1, c[1] + jax.lax.psum(x.sum(), "replica")
        return jax.lax.while_loop(lambda c: c[1] < x.sum() * 10, body, (0, 0.0))[0]

    with pytest.raises(ValueError,
                       match=r"strategy.run\(.*local_condition\): a while_loop whose trip count "
                             r".*psum"):
        strategy.run(local_condition, args=(x,), batch_argnums=(0,))

    def combined_condition(x):
        limit = jax.lax.psum(x.sum(), "replica") * 10
        return jax.lax.while_loop(lambda c: c[1] < limit,
                                  lambda c: (c[0] + 1, c[1] + jax.lax.psum(x.sum(), "replica")),
                                  (0, 0.0))[0]

    count = strategy.run(combined_condition, args=(x,), batch_argnums=(0,))
    assert isinstance(count, jax.Array) and int(count) == 10


def test_values_passed_through_together_keep_their_own_facts():
    """An optimization barrier (remat emits them) passes each operand through as its own output."""
    jaxpr = jax.make_jaxpr(lambda w, x: jax.lax.optimization_barrier((w * 2, x)))(
        jnp.ones(2), jnp.ones(2)
    )
    assert _identical.output_values(jaxpr, [False, True], ["replica"]) == ["identical", "different"]


def test_bounds_are_dropped_where_a_narrower_type_may_not_keep_them():
    """A replica id cast to bool is 0 or 1, not 0..7: no test of it is proven from the id's
    bounds."""
    def body(i):
        flag = i.astype(jnp.bool_)
        return jnp.where(flag == jnp.bool_(True), 1.0, 2.0), jnp.where(
            i.astype(jnp.int8) >= 0, 1.0, 2.0
        )

    jaxpr = jax.make_jaxpr(body)(jnp.int32(0))
    reader = _identical._Reader({"replica": 8})
    i = _identical._Fact(frozenset({"replica"}), bounds=(0, 7))
    flags = reader.read(jaxpr, [i])
    assert flags[0].axes == {"replica"}  # not proven
    assert flags[1].axes == frozenset()  # int8 holds 0..7: proven the same everywhere
