"""Unannotated steps on JAX's default mesh (`jax.make_mesh`: Explicit axes) run as plain jax.jit
runs them.

A step that type-checks under the mesh's Explicit axes keeps them; one that does not (no layout
annotations, as most Flax code) runs with those axes Auto for its program, so XLA propagates layouts
from what jaxdist resolved. Decided once per program, reported in the log and in `Plan.axis_types`;
`strategy.jit(..., axis_types=...)` forces either. The numbers are one device's either way.
"""

import functools
import logging
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist as jd
from tests.registry import adam

pytestmark = pytest.mark.timeout(300)

VOCAB, WIDTH, LENGTH = 32, 16, 8


class TinyLM(nn.Module):
    """An lm1b-shaped causal LM, written without a single layout annotation (as most Flax code
    is)."""

    attention: bool = True

    @nn.compact
    def __call__(self, tokens, valid=None):
        x = nn.Embed(VOCAB, WIDTH)(tokens)
        if self.attention:
            mask = None if valid is None else nn.make_attention_mask(valid, valid)
            attend = functools.partial(jd.nn.dot_product_attention, causal=True)
            x = x + nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=attend,
                                                    deterministic=True)(x, mask=mask)
        x = x + nn.Dense(WIDTH)(nn.gelu(nn.Dense(2 * WIDTH)(x)))
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def _tokens(batch=8, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, LENGTH)).astype(np.int32)


def _train(strategy, model, steps=3, valid=None, **jit_kwargs):
    tokens = _tokens()
    tx = adam(1e-2)

    def loss_fn(params, tokens):
        logits = model.apply(params, tokens, valid)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = model.init(jax.random.key(0), tokens[:2])
    if strategy is None:
        run, state = jax.jit(step), (params, tx.init(params))
    else:
        run = strategy.jit(step, batch_argnums=2, **jit_kwargs)
        placed = strategy.mirror(params)
        state = (placed, strategy.mirror(tx.init(params)))
    losses = []
    for _ in range(steps):
        *state, loss = run(*state, tokens)
        losses.append(float(loss))
    return losses, jax.device_get(state[0]), run


def test_an_unannotated_lm_on_a_make_mesh_mesh_equals_one_device(caplog):
    expected, params, _ = _train(None, TinyLM(attention=False))
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
    assert mesh.axis_types == (AxisType.Explicit,) * 3
    strategy = jd.ShardedStrategy(mesh=mesh, batch_axes=("data", "fsdp"), fsdp_axes="fsdp",
                                  min_shard_size=1,
                                  layout_rules=[("Dense_0/kernel", P("fsdp", "tensor"))])
    with caplog.at_level(logging.INFO, logger="jaxdist"):
        losses, got, _ = _train(strategy, TinyLM(attention=False))
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, params)
    said = [r.getMessage() for r in caplog.records if "Auto" in r.getMessage()]
    assert len(said) == 1 and "step" in said[0], said  # once per program, not per call


def test_attention_with_a_flax_padding_mask_on_a_context_axis_of_a_make_mesh_mesh():
    valid = np.ones((8, LENGTH), bool)
    valid[:, -2:] = False
    expected, _, _ = _train(None, TinyLM(), steps=2, valid=valid)
    strategy = jd.ShardedStrategy(mesh=jax.make_mesh((2, 4), ("data", "context")),
                                  batch_axes="data", context_axes="context")
    losses, _, _ = _train(strategy, TinyLM(), steps=2, valid=valid)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)


def _lookup_step(params, ids):  # an embedding lookup: refused under Explicit types with split ids
    h = jax.nn.relu(params["table"][ids] @ params["w"])
    return h.sum()


# type-checks under Explicit types (jaxdist's FSDP variables enter typed whole)
def _mlp_step(params, x):
    return (jax.nn.relu(x @ params["table"]) @ params["w"]).sum()


PARAMS = {
    "table": jax.ShapeDtypeStruct((16, 32), jnp.float32),
    "w": jax.ShapeDtypeStruct((32, 4), jnp.float32),
}


def _strategy():
    return jd.ShardedStrategy(mesh=jax.make_mesh((4, 2), ("fsdp", "tensor")), batch_axes="fsdp",
                              layout_rules=[("w", P(None, "tensor"))], min_shard_size=1)


def test_plan_reports_which_axis_types_a_program_runs_with():
    strategy = _strategy()
    auto = strategy.jit(_lookup_step, batch_argnums=1)
    plan = auto.plan(PARAMS, jax.ShapeDtypeStruct((8,), jnp.int32))
    assert plan.axis_types == {"fsdp": AxisType.Auto, "tensor": AxisType.Auto}
    assert "Axis types: Auto fsdp, tensor" in str(plan)
    # JAX's cached trace: still known
    again = auto.plan(PARAMS, jax.ShapeDtypeStruct((8,), jnp.int32))
    assert again.axis_types == plan.axis_types
    kept = strategy.jit(_mlp_step, batch_argnums=1).plan(
        PARAMS, jax.ShapeDtypeStruct((8, 16), jnp.float32)
    )
    assert kept.axis_types == {"fsdp": AxisType.Explicit, "tensor": AxisType.Explicit}
    # Same layouts, same collectives as the Auto mesh of the same shape: running Auto moves nothing
    # more.
    auto_mesh = jd.ShardedStrategy(mesh=jax.make_mesh((4, 2), ("fsdp", "tensor"),
                                                      axis_types=(AxisType.Auto,) * 2),
                                   batch_axes="fsdp", layout_rules=[("w", P(None, "tensor"))],
                                   min_shard_size=1)
    reference = auto_mesh.jit(_lookup_step, batch_argnums=1).plan(
        PARAMS, jax.ShapeDtypeStruct((8,), jnp.int32)
    )
    assert {k: c.count for k, c in plan.collectives.items()} == {
        k: c.count for k, c in reference.collectives.items()
    }
    assert plan.state_bytes == reference.state_bytes


def test_axis_types_forces_either_and_bad_values_name_the_fix():
    strategy = _strategy()
    params = strategy.mirror({"table": np.arange(512, dtype=np.float32).reshape(16, 32) / 512,
                              "w": np.ones((32, 4), np.float32)})
    ids = np.arange(8, dtype=np.int32) % 16
    expected = float(_lookup_step(jax.device_get(params), ids))
    assert float(
        strategy.jit(_lookup_step, batch_argnums=1, axis_types=AxisType.Auto)(params, ids)
    ) == pytest.approx(expected, rel=1e-6)
    assert float(strategy.jit(_lookup_step, batch_argnums=1)(params, ids)) == pytest.approx(
        expected, rel=1e-6
    )
    forced = strategy.jit(_lookup_step, batch_argnums=1, axis_types=AxisType.Explicit)
    with pytest.raises(Exception) as info:
        forced(params, ids)
    assert type(info.value).__name__ == "ShardingTypeError"
    assert any("axis_types=AxisType.Explicit" in n for n in getattr(info.value, "__notes__", []))
    with pytest.raises(ValueError, match=r"axis_types='auto' is not a jax\.sharding\.AxisType"):
        strategy.jit(_lookup_step, axis_types="auto")


def test_a_step_that_fails_both_ways_raises_the_auto_error_with_the_explicit_refusal_noted():
    strategy = _strategy()

    # needs Explicit types (an out_sharding naming an axis) AND refuses them (the lookup)
    def step(params, ids):
        h = jnp.einsum(
            "bd,dh->bh", params["table"][ids], params["w"], out_sharding=P("fsdp", "tensor")
        )
        return h.sum()

    with pytest.raises(Exception) as info:
        strategy.jit(step, batch_argnums=1).plan(PARAMS, jax.ShapeDtypeStruct((8,), jnp.int32))
    # The Auto trace's error is no type refusal (an out_sharding naming axes that run Auto): it is
    # raised, the Explicit refusal (the lookup) noted with what to do.
    assert type(info.value) is ValueError
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert ("traced first with the mesh's axes" in notes and "ShardingTypeError" in notes
            and "annotate" in notes)


def test_a_step_that_type_checks_keeps_explicit_axes_and_its_output_types(caplog):
    mesh = jax.make_mesh((8,), ("data",))
    strategy = jd.MirroredStrategy(mesh=mesh)

    def step(w, x):
        return w - 0.1 * jnp.mean(x, axis=0)

    w = strategy.mirror(np.ones(4, np.float32))
    with caplog.at_level(logging.INFO, logger="jaxdist"):
        out = strategy.jit(functools.partial(step), batch_argnums=1)(
            w, np.ones((16, 4), np.float32)
        )
    said = [r.getMessage() for r in caplog.records]
    # once, the step's name (not functools.partial's) and why
    assert len(said) == 1 and said[0].endswith(
        ".<locals>.step: runs with the mesh's axes ('data',) Explicit (its code type-checks with "
        "them); "
        "strategy.jit(..., axis_types=...) chooses."), said
    assert out.sharding.mesh == mesh and out.sharding.is_fully_replicated
    assert jax.typeof(out).sharding.mesh.axis_types == (AxisType.Explicit,)
    np.testing.assert_allclose(out, np.full(4, 0.9, np.float32))


def _token_ce(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def test_the_trainer_fits_an_unannotated_lm_on_a_make_mesh_mesh_as_one_device():
    tokens = _tokens()
    batches = [(tokens[:, :-1], tokens[:, 1:])] * 3
    model = TinyLM(attention=False)
    variables = model.init(jax.random.key(0), tokens[:2, :-1])
    reference = jd.training.Trainer(jd.OneDeviceStrategy(), model, adam(1e-2), _token_ce,
                                    variables=variables)
    want = reference.fit(batches, steps=3, log_every=1, verbose=0).metric("loss")
    strategy = jd.ShardedStrategy(mesh=jax.make_mesh((4, 2), ("data", "tensor")), batch_axes="data",
                                  layout_rules=[("Dense_0/kernel", P(None, "tensor"))],
                                  min_shard_size=1)
    trainer = jd.training.Trainer(strategy, model, adam(1e-2), _token_ce, variables=variables)
    got = trainer.fit(batches, steps=3, log_every=1, verbose=0).metric("loss")
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_an_on_device_loop_of_an_unannotated_step_on_a_make_mesh_mesh():
    strategy = jd.MirroredStrategy(mesh=jax.make_mesh((8,), ("data",)))
    table = np.arange(64, dtype=np.float32).reshape(16, 4) / 64

    def step_fn(ctx, state, ids):
        table, total = state
        # a lookup: refused under Explicit types, so the loop runs with the axis Auto
        rows = table[ids]
        ctx.set_last_step_output("rows", rows.sum(-1))
        return table, total + rows.sum()

    ids = [np.arange(8, dtype=np.int32) + i for i in range(3)]
    ctx = strategy.run_steps_on_dataset(step_fn, iter(ids), iterations=3,
                                        initial_loop_values=strategy.mirror((table, np.float32(0))))
    np.testing.assert_allclose(float(ctx.loop_values[1]), sum(table[i].sum() for i in ids),
                               rtol=1e-6)
    np.testing.assert_allclose(np.asarray(ctx.last_step_outputs["rows"]), table[ids[-1]].sum(-1),
                               rtol=1e-6)


def test_an_on_device_loop_splits_each_batch_over_the_context_axes_as_a_call_does():
    strategy = jd.ShardedStrategy(mesh=jax.make_mesh((2, 4), ("data", "context")),
                                  batch_axes="data", context_axes="context")
    seen = []

    def step_fn(ctx, total, tokens):
        seen.append(jax.typeof(tokens).sharding.spec)
        return total + tokens.sum()

    batches = [np.full((4, 8), i, np.int32) for i in range(2)]
    ctx = strategy.run_steps_on_dataset(step_fn, iter(batches), iterations=2,
                                        initial_loop_values=jnp.int32(0))
    assert int(ctx.loop_values) == 32
    call = strategy.jit(lambda tokens: tokens.sum(), batch_argnums=0)
    assert (
        call.trace(batches[0]).jaxpr.in_avals[0].sharding.spec == seen[-1] == P("data", "context")
    )


def test_a_plan_and_a_call_give_every_batch_leaf_the_same_layout():
    strategy = jd.MirroredStrategy(mesh=jax.make_mesh((8,), ("data",)))
    mesh = strategy.mesh
    step = strategy.jit(lambda w, batch: w + sum(jnp.sum(x) for x in jax.tree.leaves(batch)),
                        batch_argnums=1)
    w = strategy.mirror(np.float32(0))
    cases = {
        "placed": jax.device_put(np.ones((8, 2), np.float32), NamedSharding(mesh, P("data"))),
        "replicated": jax.device_put(np.ones((8, 2), np.float32), NamedSharding(mesh, P())),
        "host": np.ones((8, 2), np.float32),
    }
    for name, batch in cases.items():
        called = step.trace(w, batch).jaxpr.in_avals[1].sharding.spec  # the layout a call gives it
        planned = {a.path: a.layout for a in step.plan(w, batch).largest_arrays}
        assert tuple(called)[:1] == ("data",) and not any(tuple(called)[1:]), name
        assert [v.replace(", None", "") for k, v in planned.items()
                if "batch" in k] == ["P('data',)"], (name, planned)
    with pytest.raises(ValueError, match="scalar"):
        step(w, np.float32(1))
    with pytest.raises(ValueError, match="scalar"):
        step.plan(w, np.float32(1))
    placed = cases["placed"]
    # the steady path too: a Python number in a batch is an error, not a silent constant
    step(w, placed)
    for where in (step, step.plan):
        with pytest.raises(ValueError, match=r"leaf \['lr'\] is a scalar"):
            where(w, {"x": placed, "lr": 0.1})


def test_a_batch_argument_mixing_host_and_placed_leaves_is_laid_out_by_one_rule():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    strategy = jd.ShardedStrategy(mesh=mesh, batch_axes="data")  # batches split over data only
    step = strategy.jit(lambda batch: sum(jnp.sum(x) for x in jax.tree.leaves(batch)),
                        batch_argnums=0)
    eight_ways = jax.device_put(np.ones((8, 2), np.float32),
                                NamedSharding(mesh, P(("data", "model"))))
    batch = {"host": np.ones((8, 2), np.float32), "yours": eight_ways}
    called = [a.sharding.spec for a in step.trace(batch).jaxpr.in_avals]
    planned = {a.path: a.layout for a in step.plan(batch).largest_arrays}
    # The host leaf is split over the batch axes; the one the user placed keeps the user's layout,
    # in both.
    assert tuple(called[0])[:1] == ("data",) and tuple(called[1])[:1] == (("data", "model"),), (
        called
    )
    assert sorted(planned.values()) == sorted(str(P(*tuple(s)[:1])) for s in called), (
        planned,
        called,
    )
    assert float(step(batch)) == 32.0


def test_a_refused_trace_is_not_counted_as_a_compile():
    strategy = jd.ShardedStrategy(mesh=jax.make_mesh((8,), ("data",)), min_shard_size=1)
    params = strategy.mirror({"table": np.ones((16, 4), np.float32)})
    lookup = strategy.jit(lambda params, ids: params["table"][ids].sum(), batch_argnums=1)
    with warnings.catch_warnings():
        # 5 programs, each traced twice: 5 compiles
        warnings.simplefilter("error", jd.RecompileWarning)
        for n in range(1, 6):
            assert float(lookup(params, np.arange(8 * n, dtype=np.int32) % 16)) == 32.0 * n


def _mlp(sizes=(16, 32, 32, 8)):
    keys = jax.random.split(jax.random.key(0), len(sizes) - 1)
    return [{"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
            for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=False)]


def _predict(params, x):
    for layer in params:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x


def _sgd(loss):
    def step(params, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    return step


def _plain_loss(params, batch):
    x, y = batch
    return jnp.mean((_predict(params, x) - y) ** 2)


def _shard_map_loss(params, batch):
    """JAX's shard_map tutorial FSDP: the loss gathers its parameters itself, in_specs from their
    types."""

    def local(params, batch):
        params = jax.tree.map(lambda p: jax.lax.all_gather(p, "batch", tiled=True), params)
        return jax.lax.pmean(_plain_loss(params, batch), "batch")

    return jax.shard_map(local, out_specs=P())(params, batch)


def test_a_layout_the_user_placed_is_its_type_and_jaxdists_own_split_is_typed_whole():
    mesh = jax.make_mesh((4,), ("batch",), devices=jax.devices()[:4])
    # jaxdist's rule splits every variable's rows: the tutorial's own layout.
    strategy = jd.ShardedStrategy(mesh=mesh, batch_axes="batch", fsdp_axes="batch",
                                  layout_rules=[(r"\d+/[wb]$", P("batch"))])
    params = _mlp()
    rng = np.random.default_rng(0)
    batch = (rng.normal(size=(32, 16)).astype(np.float32),
             rng.normal(size=(32, 8)).astype(np.float32))
    ours = strategy.create_variables(lambda: params)
    assert all(a.sharding.spec == P("batch") for a in jax.tree.leaves(ours))
    # The user places the same parameters with the very same specs, by hand (the tutorial's
    # device_put).
    users = jax.tree.map(lambda a: jax.device_put(np.asarray(a),
                                                  NamedSharding(mesh, a.sharding.spec)), ours)
    assert all(a.sharding == b.sharding for a, b in zip(jax.tree.leaves(ours),
                                                        jax.tree.leaves(users), strict=True))
    with jax.set_mesh(mesh):
        placed = jax.device_put(batch, NamedSharding(mesh, P("batch")))
        expected = jax.jit(_sgd(_shard_map_loss))(users, placed)
        reference = jax.jit(_sgd(_plain_loss))(params, batch)

    # The user's layout stays the type the shard_map infers its in_specs from (jaxdist typing it
    # whole would gather it twice: a shape error), and the program's outputs stay the user's on the
    # next call.
    step = strategy.jit(_sgd(_shard_map_loss), batch_argnums=1)
    got = step(users, batch)
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), got[0],
                 expected[0])
    step(got[0], batch)

    # One step, both placements, equal specs: jaxdist's own split enters typed whole, so the
    # unannotated loss type-checks Explicit; the user's keeps its split type, does not, and runs
    # Auto. Same numbers.
    traces = []

    def counted(params, batch):
        traces.append(1)
        return _sgd(_plain_loss)(params, batch)

    plain = strategy.jit(counted, batch_argnums=1)
    assert set(plain.axis_types_of(plain.trace(ours, batch)).values()) == {AxisType.Explicit}
    assert set(plain.axis_types_of(plain.trace(users, batch)).values()) == {AxisType.Auto}
    for start in (ours, users, ours):
        new, loss = plain(start, batch)
        np.testing.assert_allclose(loss, reference[1], rtol=1e-5)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), new,
                     reference[0])
    # The outputs of jaxdist's split are jaxdist's: the next steps trace nothing new.
    seen = len(traces)
    plain(plain(new, batch)[0], batch)
    assert len(traces) == seen


def test_an_annotated_nnx_model_flax_placed_compiles_once_and_equals_nnx_jit():
    # Flax's MiniGPT shape: jax.set_mesh at import, Linear kernels annotated out_sharding=P(None,
    # "model") that Flax places itself, an unannotated embedding, nnx.Optimizer updated in place.
    # The annotated Variables' layouts are the user's before and after a step, so the program's
    # cache key does not change: one trace.

    mesh = jax.make_mesh((2, 4), ("batch", "model"))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.emb = nnx.Embed(64, 32, rngs=rngs)
            self.up = nnx.Linear(32, 64, rngs=rngs,
                                 kernel_metadata={"out_sharding": P(None, "model")},
                                 bias_metadata={"out_sharding": P("model")})
            self.down = nnx.Linear(64, 64, rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.relu(self.up(self.emb(x, out_sharding=jax.typeof(x).sharding))))

    traces = []

    def train_step(model, optimizer, batch):
        traces.append(1)

        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(batch), batch).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    tokens = np.random.default_rng(0).integers(0, 64, (8, 16)).astype(np.int32)
    losses = {}
    with jax.set_mesh(mesh):
        for name in ("nnx.jit", "jaxdist"):
            model = Model(nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
            batch = jax.device_put(tokens, P("batch"))
            step = (
                nnx.jit(train_step)
                if name == "nnx.jit"
                else jd.ShardedStrategy(mesh=mesh, batch_axes="batch").jit(
                    train_step, batch_argnums=2
                )
            )
            traces.clear()
            losses[name] = [float(step(model, optimizer, batch)) for _ in range(3)]
            assert len(traces) == 1, (name, len(traces))
    np.testing.assert_allclose(losses["jaxdist"], losses["nnx.jit"], rtol=1e-5)


def test_the_nnx_tutorial_loop_resets_its_metrics_under_the_strategys_scope():
    # The NNX tutorial's loop: the step updates nnx metrics in place, the loop computes and resets
    # them eagerly. On jax.make_mesh's Explicit mesh the metrics' arrays are typed with it; the
    # reset runs under scope().
    mesh = jax.make_mesh((8,), ("data",))
    strategy = jd.ShardedStrategy(mesh=mesh, batch_axes="data")
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))

    def train_step(model, optimizer, metrics, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        metrics.update(loss=loss)
        optimizer.update(model, grads)

    step = strategy.jit(train_step, batch_argnums=(3, 4))
    x, y = np.ones((16, 4), np.float32), np.zeros((16, 2), np.float32)
    losses = []
    for _ in range(2):
        step(model, optimizer, metrics, x, y)
        losses.append(float(metrics.compute()["loss"]))
        with strategy.scope():
            metrics.reset()
    assert losses[1] < losses[0]
    assert float(metrics.loss.count[...]) == 0  # reset
