"""Flax partitioning annotations drive `ShardedStrategy`'s layout: logical axis rules, precedence,
reports, activation constraints, and nnx variables annotated with ``nnx.with_partitioning`` through
the Trainer."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from registry import adam

import jaxdist as jd

RULES = (("batch", "replica"), ("embed", None), ("mlp", "model"))


def logical(names, init=None):
    return nn.with_logical_partitioning(init or nn.initializers.lecun_normal(), names)


class MLP(nn.Module):
    """Logical names on the hidden layer, mesh axes (``nn.with_partitioning``) on the output kernel,
    and an activation constraint in between."""

    features: int = 16

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(
            self.features,
            kernel_init=logical(("embed", "mlp")),
            bias_init=logical(("mlp",), nn.initializers.zeros_init()),
            name="hidden",
        )(x)
        h = nn.with_logical_constraint(nn.relu(h), ("batch", "mlp"))
        return nn.Dense(
            4, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("model", None)),
            name="out"
        )(h)


MODEL, OPT = MLP(), adam(1e-2)


def init(key):
    params = MODEL.init(key, jnp.zeros((1, 8)))
    return params, OPT.init(params)


def step(state, x, y):
    params, opt_state = state
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((MODEL.apply(p, x) - y) ** 2))(params)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


def tp_strategy(rules=RULES, activation_axes=("batch",), **kwargs):
    return jd.ShardedStrategy(
        model_parallelism=2, min_shard_size=1, logical_axis_rules=rules,
        activation_axes=activation_axes, **kwargs
    )


def spec(box):
    return box.value.sharding.spec


def test_annotations_place_params_and_optimizer_state_as_annotated():
    strategy = tp_strategy()
    params, (adam, _) = strategy.create_variables(init, jax.random.key(0))
    p = params["params"]
    # ("embed", "mlp"): embed kept whole by its rule
    assert spec(p["hidden"]["kernel"]) == P(None, "model")
    # really split
    assert {s.data.shape for s in p["hidden"]["kernel"].value.addressable_shards} == {(8, 8)}
    assert spec(p["hidden"]["bias"]) == P("model")
    assert spec(p["out"]["kernel"]) == P("model")  # nn.with_partitioning: mesh axes as named
    assert p["out"]["bias"].sharding.spec == P("replica")  # not annotated: the FSDP rule
    # optimizer state follows its parameter (it holds the same boxes)
    for moment in (adam.mu, adam.nu):
        assert spec(moment["params"]["hidden"]["kernel"]) == P(None, "model")
        assert spec(moment["params"]["out"]["kernel"]) == P("model")
    assert strategy.variable_layouts(params)["params/hidden/kernel"] == P(None, "model")


def test_precedence_layout_rules_then_annotation_then_fsdp():
    # A logical name with no rule at all ("embed" here) is FSDP's to split over the replicas.
    fallback = tp_strategy(rules=(("mlp", "model"),))
    params, _ = fallback.create_variables(init, jax.random.key(0))
    assert spec(params["params"]["hidden"]["kernel"]) == P("replica", "model")
    # A layout_rules regex overrides the annotation (and its optimizer state follows it too).
    override = tp_strategy(layout_rules=[(r"hidden/kernel", P())])
    with pytest.warns(jd.UnmatchedLayoutRuleWarning,
                      match=r"logical_axis_rules\[1\]=\('embed', None\)"):
        # no "embed" left to place
        params, (adam, _) = override.create_variables(init, jax.random.key(0))
    assert (spec(params["params"]["hidden"]["kernel"]) == P()
            and spec(adam.mu["params"]["hidden"]["kernel"]) == P())
    assert spec(params["params"]["hidden"]["bias"]) == P("model")
    # Strategies that replicate every variable ignore annotations.
    mirrored = jd.MirroredStrategy()
    params, _ = mirrored.create_variables(init, jax.random.key(0))
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(params))


def test_annotated_training_equals_one_device_and_keeps_layout():
    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(16, 4)).astype(np.float32))
        for _ in range(3)
    ]
    reference = init(jax.random.key(0))
    strategy = tp_strategy()
    state = strategy.create_variables(init, jax.random.key(0))
    layout = jax.tree.map(lambda x: x.sharding, state)
    # traced in the scope: the activation constraint and unbox constraints apply
    with strategy.scope():
        tp_step = strategy.jit(step, donate_argnums=(0,), batch_argnums=(1, 2))
        for x, y in batches:
            reference, want = jax.jit(step)(reference, x, y)
            state, got = tp_step(state, x, y)
            np.testing.assert_allclose(got, want, rtol=1e-5)
    assert jax.tree.map(lambda x: x.sharding, state) == layout
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_activation_constraint_uses_the_strategy_rules_in_its_steps():
    """``nn.with_logical_constraint`` in a model: a step of a strategy with ``logical_axis_rules``
    is traced with its rules and mesh, inside ``strategy.scope()`` or not, so the activation takes
    the rule's layout; a strategy without rules leaves it to XLA (tracing under a mesh with no
    rules, Flax would replicate the names no rule maps). Same math either way."""
    seen = []

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.with_logical_constraint(nn.Dense(16)(x), ("batch", "hidden"))
            jax.debug.inspect_array_sharding(
                h, callback=lambda s: seen.append(getattr(s, "spec", None))
            )
            return nn.Dense(1)(h).mean()

    net = Net()
    strategy = tp_strategy(rules=(("batch", "replica"), ("hidden", "model")),
                           activation_axes=("batch", "hidden"))
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    params = strategy.create_variables(net.init, jax.random.key(0), x[:1])
    seen.clear()
    with strategy.scope():
        inside = strategy.jit(lambda p, x: net.apply(p, x), batch_argnums=1)(params, x)
    outside = strategy.jit(lambda p, x: net.apply(p, x) + 0.0, batch_argnums=1)(params, x)
    # batch over the replicas, hidden over the model axis
    assert seen[0] == seen[1] == P("replica", "model")
    plain = jd.ShardedStrategy(model_parallelism=2, min_shard_size=1)  # no rules: XLA's own choice
    # no rule splits anything over it
    with pytest.warns(jd.strategies.IdleAxisWarning, match="'model'"):
        plain_params = plain.create_variables(lambda k, x: nn.unbox(net.init(k, x)),
                                              jax.random.key(0), x[:1])
    unconstrained = plain.jit(lambda p, x: net.apply(p, x) * 1.0, batch_argnums=1)(plain_params, x)
    assert seen[2] != P("replica", "model")
    np.testing.assert_allclose(inside, net.apply(jax.device_get(params), x), rtol=1e-5)
    np.testing.assert_allclose(outside, inside, rtol=1e-5)
    np.testing.assert_allclose(unconstrained, inside, rtol=1e-5)


def test_gradients_returned_by_a_step_keep_the_annotated_layout():
    """An output not shaped like an argument (gradients returned next to the loss) is laid out like
    the variables it mirrors: annotated parameters' gradients take the annotation's layout, not the
    FSDP rule."""
    strategy = tp_strategy()
    params, _ = strategy.create_variables(init, jax.random.key(0))
    x = np.ones((8, 8), np.float32)

    def grads(p, x):
        return jax.grad(lambda p: MODEL.apply(p, x).sum())(p), x.sum()

    g, _ = strategy.jit(grads, batch_argnums=1)(params, x)
    specs = jax.tree.map(lambda a: a.sharding.spec, nn.unbox(g))
    want = jax.tree.map(lambda a: a.sharding.spec, nn.unbox(params))
    assert specs == want


def test_unmatched_rules_are_reported_once_naming_the_entry():
    strategy = tp_strategy(
        rules=(("batch", "replica"), ("mpl", "model"), ("mlp", "model")),
        layout_rules=[(r"hiden/kernel", P())]
    )
    with pytest.warns(jd.UnmatchedLayoutRuleWarning) as record:
        strategy.create_variables(init, jax.random.key(0))
    message = str(record[0].message)
    assert "layout_rules[0]=('hiden/kernel', P())" in message
    assert "logical_axis_rules[1]=('mpl', 'model')" in message
    assert "batch" not in message.split(" matched")[0]  # declared in activation_axes: not reported
    assert "'embed', 'mlp'" in message  # the names the variables do use
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy.create_variables(init, jax.random.key(1))  # reported once per strategy
    # Unboxed params carry no annotation: every logical rule is unmatched, and the message says why.
    unboxed = tp_strategy()
    with pytest.warns(jd.IdleAxisWarning), pytest.warns(
        jd.UnmatchedLayoutRuleWarning, match="no variable carries a logical annotation"
    ):
        unboxed.create_variables(lambda key: nn.unbox(MODEL.init(key, jnp.zeros((1, 8)))),
                                 jax.random.key(0))
    assert tp_strategy().unmatched_rules(jax.eval_shape(init, jax.random.key(0))) == []


def test_bad_rules_and_annotations_are_clear_errors():
    with pytest.raises(ValueError,
                       match=r"logical_axis_rules\[0\]=\('mlp', 'model'\).*model_parallelism > 1"):
        jd.ShardedStrategy(logical_axis_rules=[("mlp", "model")])
    with pytest.raises(ValueError,
                       match=r"logical_axis_rules\[1\]='mlp' is not a \(logical_name, mesh_axes\) "
                             r"pair"):
        tp_strategy(rules=[("embed", None), "mlp"])
    with pytest.raises(ValueError, match=r"activation_axes='batch' must be a sequence"):
        jd.ShardedStrategy(activation_axes="batch")
    data_axis = nn.Dense(
        4, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("data", None))
    )
    with pytest.raises(ValueError, match=r"kernel.*names mesh axis 'data'.*logical_axis_rules"):
        tp_strategy().create_variables(data_axis.init, jax.random.key(0), jnp.ones((1, 8)))
    too_many = nn.Dense(4, kernel_init=logical(("embed", "mlp", "extra")))
    with pytest.raises(
        ValueError,
        match=r"annotation \('embed', 'mlp', 'extra'\) of variable 'params/kernel' names 3 "
        r"axes but the variable has shape \(8, 4\)",
    ):
        tp_strategy().create_variables(too_many.init, jax.random.key(0), jnp.ones((1, 8)))
    odd = MLP(features=5)  # "mlp" (5) over the model axis (2)
    with pytest.raises(
        ValueError,
        match=r"annotation \('mlp',\) through logical_axis_rules to P\('model',\) splits "
        r"axis 0 \(size 5\) of variable 'params/hidden/bias' into 2 parts, which does not divide "
        r"it: .* ShardedStrategy\(layout_rules=\[\('\^params/hidden/bias\$', PartitionSpec",
    ):
        tp_strategy().create_variables(odd.init, jax.random.key(0), jnp.ones((1, 8)))
    # the fix it names (for the kernels, 8 x 5 and 5 x 4, as well), the model unchanged: rules
    # come before annotations (which leaves the logical rules unused)
    fixed = tp_strategy(layout_rules=[("^params/hidden/bias$", P()),
                                      ("^params/(hidden|out)/kernel$", P())])
    with pytest.warns(jd.UnmatchedLayoutRuleWarning):
        params = fixed.create_variables(odd.init, jax.random.key(0), jnp.ones((1, 8)))["params"]
    assert all(spec(params[layer][name]) == P()
               for layer, name in (("hidden", "bias"), ("hidden", "kernel"), ("out", "kernel")))


def test_a_mesh_axis_the_strategy_lacks_is_named_with_the_fix_inside_scope():
    """Inside scope() Flax applies nn/nnx.with_partitioning on the strategy's mesh; an axis it lacks
    is JAX's terse error (which names the axis), and the scope notes the mesh's axes and the fix."""
    mirrored = jd.MirroredStrategy()
    model_axis = nn.Dense(
        4, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
    )
    expected = (
        r"(?s)MirroredStrategy.scope\(\), where the ambient mesh is this strategy's, axes "
        r"\('replica',\).*names an axis this mesh does not have.*logical_axis_rules"
    )
    for build in (
        lambda: mirrored.create_variables(model_axis.init, jax.random.key(0), jnp.ones((1, 8))),
        lambda: AnnotatedNnx(nnx.Rngs(0)),
    ):
        with pytest.raises(ValueError,
                           match=expected) as raised, mirrored.scope(), mirrored.scope():
            build()
        assert "model" in str(raised.value)  # JAX's own message, unchanged, names the axis
        # one note, scope re-entered
        assert sum("jaxdist:" in note for note in raised.value.__notes__) == 1
    # other errors keep their type and message
    with pytest.raises(ValueError) as raised, mirrored.scope():
        raise ValueError("unrelated")
    assert str(raised.value) == "unrelated" and not getattr(raised.value, "__notes__", [])
    explicit = jd.MirroredStrategy(mesh=jax.make_mesh((8,), ("data",)))
    bias = explicit.mirror(jnp.ones(4))
    # a rank mismatch: not about the mesh's axes
    with pytest.raises(ValueError) as raised, explicit.scope():
        jax.sharding.reshard(bias, jax.sharding.PartitionSpec(None, None))
    assert not [n for n in getattr(raised.value, "__notes__", []) if "jaxdist" in n]


class LogicalNnx(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.hidden = nnx.Linear(8, 16, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
                                 rngs=rngs)


def test_nnx_logical_names_need_a_rule_each_and_the_error_says_so():
    """nnx (unlike linen) passes a logical name with no rule through as a mesh axis: the error names
    the rule to add; with it, the variable is created in the layout the rules give."""
    with pytest.raises(ValueError,
                       match=r"(?s)logical_axis_rules map \('mlp',\).*give that name a rule.*"
                       r"add \(name, None\)") as raised:
        with tp_strategy(rules=[("mlp", "model")], activation_axes=()).scope():
            LogicalNnx(nnx.Rngs(0))
    assert "embed" in str(raised.value)  # JAX's own message names the axis
    with tp_strategy(rules=[("embed", "replica"), ("mlp", "model")], activation_axes=()).scope():
        model = LogicalNnx(nnx.Rngs(0))
    assert model.hidden.kernel[...].sharding.spec == P("replica", "model")


class AnnotatedNnx(nnx.Module):
    def __init__(self, rngs, annotate=True):
        init = nnx.initializers.lecun_normal()
        kernel_init = nnx.with_partitioning(init, (None, "model")) if annotate else init
        self.hidden = nnx.Linear(8, 16, kernel_init=kernel_init, rngs=rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def test_nnx_annotated_model_created_in_scope_keeps_its_layout_through_trainer_and_checkpoint(
    tmp_path,
):
    rng = np.random.default_rng(0)
    data = [
        (rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(16, 4)).astype(np.float32))
        for _ in range(3)
    ]

    def mse(out, y):
        return jnp.mean((out - y) ** 2)

    strategy = jd.ShardedStrategy(model_parallelism=2, min_shard_size=1)
    with strategy.scope():
        model = AnnotatedNnx(nnx.Rngs(0))
    trainer = jd.training.Trainer(strategy, model, adam(1e-2), mse)
    trainer.fit(data, steps=3, verbose=0, checkpoint_dir=tmp_path)
    kernel = trainer.state.params["hidden"]["kernel"]
    # the Variable itself, its annotation in its metadata (no linen box)
    assert isinstance(kernel, nnx.Param)
    assert kernel[...].sharding.spec == P(None, "model")  # as annotated, not the FSDP rule
    mu = trainer.state.opt_state[0].mu["hidden"]["kernel"]
    assert mu[...].sharding.spec == P(None, "model")  # the optimizer state follows it
    assert trainer.state.params["out"]["kernel"].sharding.spec == P("replica")  # unannotated: FSDP
    assert model.hidden.kernel[...].sharding.spec == P(None, "model")  # synced back in its layout

    reference = jd.training.Trainer(
        jd.OneDeviceStrategy(), AnnotatedNnx(nnx.Rngs(0), annotate=False), adam(1e-2), mse
    )
    reference.fit(data, steps=3, verbose=0)
    np.testing.assert_allclose(kernel[...], reference.state.params["hidden"]["kernel"], rtol=1e-5,
                               atol=1e-6)

    with strategy.scope():
        fresh = AnnotatedNnx(nnx.Rngs(1))
    restored = jd.training.Trainer(strategy, fresh, adam(1e-2), mse)
    assert restored.restore(tmp_path, batch=data[0]) == 3
    assert restored.state.params["hidden"]["kernel"][...].sharding.spec == P(None, "model")
    np.testing.assert_allclose(restored.state.params["hidden"]["kernel"][...], kernel[...])

    # the same annotated model, off any mesh: restored on one device
    with nnx.use_eager_sharding(False):
        single = jd.training.Trainer(jd.OneDeviceStrategy(), AnnotatedNnx(nnx.Rngs(2)), adam(1e-2),
                                     mse)
    assert single.restore(tmp_path, batch=data[0]) == 3
    np.testing.assert_allclose(single.state.params["hidden"]["kernel"][...], kernel[...])
    # and trains on there: the same next step as on the FSDP x TP strategy
    single.fit(data, steps=4, verbose=0)
    restored.fit(data, steps=4, verbose=0)
    np.testing.assert_allclose(single.state.params["hidden"]["kernel"][...],
                               restored.state.params["hidden"]["kernel"][...], rtol=1e-5, atol=1e-6)


def test_trainer_reads_nnx_annotations_as_strategy_jit_does():
    """One nnx path: the Trainer lays an nnx model's Variables out by their metadata, through the
    strategy's logical rules, exactly as ``strategy.jit`` lays out the same model passed to a step:
    here a model built off any mesh (its logical names not yet resolved by Flax), which only the
    metadata says how to split."""
    strategy = tp_strategy(rules=[("embed", None), ("mlp", "model")], activation_axes=())
    with nnx.use_eager_sharding(False):
        model = LogicalNnx(nnx.Rngs(0))

    def loss(out, y):
        return jnp.mean((out - y) ** 2)

    class Head(nnx.Module):
        def __init__(self, body):
            self.body = body

        def __call__(self, x):
            return self.body.hidden(x)

    trainer = jd.training.Trainer(strategy, Head(model), optax.sgd(0.1), loss)
    x, y = np.ones((8, 8), np.float32), np.ones((8, 16), np.float32)
    trainer.fit([(x, y)], steps=1, verbose=0)
    trained = trainer.state.params["body"]["hidden"]["kernel"]
    assert trained[...].sharding.spec == P(None, "model")  # the metadata's names through the rules

    with nnx.use_eager_sharding(False):
        same = LogicalNnx(nnx.Rngs(0))
    kernel = strategy.jit(lambda m, x: nnx.state(m), batch_argnums=1)(same, x)["hidden"]["kernel"]
    # strategy.jit reads them the same way
    assert kernel[...].sharding.spec == trained[...].sharding.spec


class WidthOne(nnx.Module):
    """A regression net whose output layer (width 1) carries its hidden layer's annotation."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.w1 = nnx.Param(init(rngs.params(), (1, 32)), out_sharding=(None, "model"))
        self.b1 = nnx.Param(jnp.zeros((32,)), out_sharding=("model",))
        self.w2 = nnx.Param(init(rngs.params(), (32, 1)), out_sharding=(None, "model"))

    def __call__(self, x):
        return nnx.relu(x @ self.w1 + self.b1) @ self.w2


def test_a_dimension_of_size_one_stays_whole_whatever_its_annotation_names():
    """Splitting a dimension of size 1 would hold its one element on a device and padding on the
    others: plain JAX keeps it whole on Auto axes (the width-1 output layer above is created whole
    under ``jax.set_mesh``), and so does the strategy, for annotations and layout rules alike. The
    step equals ``nnx.jit``'s; the other annotated variables keep their layout."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))  # Auto

    def train_step(model, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(model, nnx.Param),
                                       grads))
        return loss

    with jax.set_mesh(mesh):
        plain, ported = (nnx.jit(lambda: WidthOne(nnx.Rngs(0)))() for _ in range(2))
    assert plain.w2[...].sharding.spec == P()  # what JAX made of (None, "model") on (32, 1)
    strategy = jd.ShardedStrategy(mesh=mesh, batch_axes=("data",))
    step = strategy.jit(train_step)
    rng = np.random.default_rng(0)
    data = jax.sharding.NamedSharding(mesh, P("data"))
    for _ in range(3):
        x = rng.uniform(-2, 2, size=(16, 1)).astype(np.float32)
        x, y = jax.device_put((x, 0.8 * x**2 + 0.1), data)
        np.testing.assert_allclose(step(ported, x, y), nnx.jit(train_step)(plain, x, y),
                                   rtol=1e-5)
    for name, layout in (("w1", P(None, "model")), ("b1", P("model")), ("w2", P())):
        assert getattr(ported, name)[...].sharding.spec == layout, name
        np.testing.assert_allclose(getattr(ported, name)[...], getattr(plain, name)[...],
                                   rtol=1e-5, atol=1e-6)
    # a layout rule naming a mesh axis for that dimension: whole too; a linen annotation alike, on
    # Auto axes and on jax.make_mesh's Explicit ones
    width_one = nn.Dense(1, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(),
                                                             (None, "model")))
    for on in (mesh, jax.make_mesh((2, 4), ("data", "model"))):
        tp = jd.ShardedStrategy(mesh=on, batch_axes=("data",), min_shard_size=1)
        ruled = jd.ShardedStrategy(mesh=on, batch_axes=("data",), min_shard_size=1,
                                   layout_rules=[(r"kernel", P(None, "model"))])
        for strategy, model in ((ruled, nn.Dense(1)), (tp, width_one)):
            params = strategy.create_variables(model.init, jax.random.key(0), jnp.ones((1, 8)))
            kernel = params["params"]["kernel"]
            assert getattr(kernel, "value", kernel).sharding.spec == P()
