"""The user's own mesh and axis names: ShardedStrategy(mesh=..., batch_axes=..., fsdp_axes=...).

An lm1b-shaped program (Flax's lm1b and MaxText shape theirs this way): a linen transformer whose
parameters name logical axes, a ``("data", "fsdp", "tensor")`` mesh, a rule table naming THOSE axes,
and a train step written for one device (``TrainState.apply_gradients``, a batch dict, static config
arguments, a dropout rng folded with the step). Run unmodified through ``strategy.jit``, it must
equal one device; so must HSDP and Mirrored / TPU on a user mesh. Bad meshes and rules are errors
naming the axis and the fix.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import PartitionSpec

import jaxdist as jd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from char_lm import CharLM, LMConfig

CONFIG = LMConfig(vocab_size=32, d_model=16, num_heads=4, num_layers=1, mlp_dim=32, max_len=8)
# lm1b's own table (configs/default.py) names its mesh's axes; the batch rule is MaxText's.
LM1B_RULES = [("mlp", "tensor"), ("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor")]


AUTO2 = (jax.sharding.AxisType.Auto,) * 2  # the LM below is unannotated: it needs Auto axes


def mesh3(shape=(2, 2, 2), axis_types=jax.sharding.AxisType.Auto):
    # lm1b builds its mesh with Auto axes (Mesh(create_device_mesh(...), names)): its unannotated
    # code needs them.
    return jax.make_mesh(shape, ("data", "fsdp", "tensor"), axis_types=(axis_types,) * 3)


def learning_rate_fn(step):
    return 1e-2 * jnp.minimum(1.0, (step + 1) / 4)


def train_step(state, batch, config, learning_rate_fn, label_smoothing=0.0, dropout_rng=None):
    """lm1b's step, shape for shape: nothing in it knows about devices."""
    inputs = batch["inputs"]
    weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)
    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params):
        logits = CharLM(config).apply({"params": params}, inputs[:, :-1])
        onehot = jax.nn.one_hot(inputs[:, 1:], config.vocab_size)
        soft = optax.smooth_labels(onehot, label_smoothing) if label_smoothing else onehot
        loss = (optax.softmax_cross_entropy(logits, soft) * weights[:, 1:]).sum()
        return loss / weights[:, 1:].sum(), logits

    (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    new_state = state.apply_gradients(grads=grads)
    return new_state, {"loss": loss, "learning_rate": learning_rate_fn(state.step),
                       "noise": jax.random.uniform(dropout_rng)}


def create_state(key):
    params = CharLM(CONFIG).init(key, jnp.ones((1, CONFIG.max_len), jnp.int32))["params"]
    tx = optax.adamw(learning_rate_fn, eps=1e-2)  # eps = the peak rate (see registry.adam)
    return train_state.TrainState.create(apply_fn=None, params=params, tx=tx)


def data(steps=4, batch=16):
    rng = np.random.default_rng(3)
    return [{"inputs": rng.integers(0, CONFIG.vocab_size,
                                    size=(batch, CONFIG.max_len + 1)).astype(np.int32)}
            for _ in range(steps)]


def run(step, state):
    metrics = []
    for batch in data():
        state, m = step(state, batch, CONFIG, learning_rate_fn, 0.1, jax.random.key(5))
        metrics.append(jax.tree.map(float, m))
    return state, metrics


@functools.cache
def reference():
    return run(jax.jit(train_step, static_argnums=(2, 3, 4)), create_state(jax.random.key(0)))


def assert_equals_one_device(strategy):
    state = strategy.create_variables(create_state, jax.random.key(0))
    step = strategy.jit(train_step, static_argnums=(2, 3, 4), donate_argnums=0, batch_argnums=1)
    with strategy.scope():
        state, metrics = run(step, state)
    ref_state, ref_metrics = reference()
    for got, want in zip(metrics, ref_metrics, strict=True):
        np.testing.assert_allclose([got[k] for k in sorted(got)], [want[k] for k in sorted(want)],
                                   rtol=1e-5)
    for got, want in zip(jax.tree.leaves(nn.unbox(state.params)),
                         jax.tree.leaves(nn.unbox(ref_state.params)), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    return state


@pytest.mark.slow
def test_lm1b_shaped_program_on_a_data_fsdp_tensor_mesh_equals_one_device():
    """MaxText's layout: the batch over data x fsdp, FSDP over fsdp (the 'embed' rule), TP over
    tensor."""
    strategy = jd.ShardedStrategy(
        mesh=mesh3(), batch_axes=("data", "fsdp"), fsdp_axes=("fsdp",), min_shard_size=1,
        logical_axis_rules=[*LM1B_RULES, ("batch", ("data", "fsdp"))], activation_axes=("batch",),
    )
    assert strategy.num_replicas_in_sync == 4 and strategy.mesh.axis_names == (
        "data",
        "fsdp",
        "tensor",
    )
    state = assert_equals_one_device(strategy)
    layouts = strategy.variable_layouts(state.params)
    # ('embed', 'mlp'), verbatim
    assert layouts["block_0/mlp_in/kernel"] == PartitionSpec("fsdp", "tensor")
    assert layouts["embed/embedding"] == PartitionSpec("tensor", "fsdp")  # ('vocab', 'embed')
    assert layouts["block_0/query"] == PartitionSpec("fsdp", "tensor")  # ('embed', 'heads', 'kv')


def test_lm1b_own_layout_batch_over_data_only_equals_one_device():
    """lm1b's data_sharding=['data']: the batch over 'data' alone; 'fsdp' and 'tensor' only through
    its rules."""
    strategy = jd.ShardedStrategy(mesh=mesh3(), batch_axes="data", fsdp_axes=(), min_shard_size=1,
                                  logical_axis_rules=LM1B_RULES)
    assert strategy.num_replicas_in_sync == 2 and strategy.policy.roles.model_axes == (
        "fsdp",
        "tensor",
    )
    assert_equals_one_device(strategy)


@pytest.mark.slow
def test_hsdp_on_one_process_equals_one_device_and_shards_within_the_fsdp_axis():
    mesh = jax.make_mesh((2, 4), ("replicate", "shard"), axis_types=AUTO2)
    strategy = jd.ShardedStrategy(mesh=mesh, batch_axes=("replicate", "shard"), fsdp_axes="shard",
                                  min_shard_size=1)
    state = assert_equals_one_device(strategy)
    # (16, 32): split 4 ways, 2 copies
    kernel = nn.unbox(state.params)["block_0"]["mlp_in"]["kernel"]
    assert kernel.sharding.spec == PartitionSpec(None, "shard")
    assert {s.data.size for s in kernel.addressable_shards} == {kernel.size // 4}


def test_data_parallel_strategies_take_a_user_mesh():
    tpu = jd.TPUStrategy(mesh=jax.make_mesh((2, 4), ("dcn", "ici"), axis_types=AUTO2),
                         steps_per_run=2)
    assert tpu.num_replicas_in_sync == 8 and tpu.batch_sharding.spec == PartitionSpec(
        ("dcn", "ici")
    )
    strategy = jd.MirroredStrategy(mesh=jax.make_mesh((2, 4), ("dcn", "ici"), axis_types=AUTO2))
    assert strategy.axis_name == ("dcn", "ici")  # what replica functions' collectives name
    assert int(strategy.run(lambda: jax.lax.psum(1, strategy.axis_name))) == 8
    assert_equals_one_device(strategy)


def test_run_on_a_user_mesh_splits_rows_over_the_batch_axes():
    strategy = jd.ShardedStrategy(mesh=mesh3(), batch_axes=("data", "fsdp"), min_shard_size=1,
                                  logical_axis_rules=[("mlp", "tensor")])
    x = np.arange(8, dtype=np.float32)
    ids = strategy.run(lambda x: x * 0 + jd.get_replica_context().replica_id_in_sync_group,
                       args=(x,), batch_argnums=0)
    np.testing.assert_array_equal(strategy.gather(ids), [0, 0, 1, 1, 2, 2, 3, 3])
    mean = strategy.run(lambda x: jd.get_replica_context().all_reduce("mean", x.sum()), args=(x,),
                        batch_argnums=0)
    assert float(mean) == pytest.approx(x.sum() / 4)
    with pytest.raises(ValueError,
                       match=r"axis_name='batch'.*\('data', 'fsdp'\).*strategy.axis_name"):
        strategy.run(lambda x: x, args=(x,), batch_argnums=0, axis_name="batch")


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"mesh": "2x4"}, TypeError, r"mesh='2x4' \(type str\) is not a jax.sharding.Mesh"),
    ({"mesh": "M3"}, ValueError,
     r"batch_axes is missing: the mesh has axes \('data', 'fsdp', 'tensor'\)"),
    ({"mesh": "M3", "batch_axes": ("data", "dp")}, ValueError,
     r"batch_axes=\('data', 'dp'\) names axis 'dp'"),
    ({"mesh": "M3", "batch_axes": ("data", "data")}, ValueError, r"lists axis 'data' twice"),
    ({"mesh": "M3", "batch_axes": "data", "fsdp_axes": "tensor"}, ValueError,
     r"fsdp_axes='tensor' names 'tensor', which is not in batch_axes=\('data',\).*add it to "
     r"batch_axes"),
    ({"mesh": "M3", "batch_axes": "data", "logical_axis_rules": [("mlp", "model")]}, ValueError,
     r"maps 'mlp' to mesh axis 'model', but the mesh axes are \('data', 'fsdp', 'tensor'\)"),
    ({"mesh": "M3", "batch_axes": "data", "devices": "all"}, ValueError,
     r"both devices= and mesh="),
])
def test_bad_meshes_and_roles_are_errors_naming_the_axis(kwargs, error, match):
    kwargs = dict(kwargs)
    kwargs["mesh"] = mesh3() if kwargs["mesh"] == "M3" else kwargs["mesh"]
    if kwargs.get("devices") == "all":
        kwargs["devices"] = jax.devices()
    with pytest.raises(error, match=match):
        jd.ShardedStrategy(**kwargs)


def test_mirrored_rejects_model_axes_and_batches_must_divide_the_batch_axes():
    with pytest.raises(ValueError,
                                         match=r"mirroring strategy \(Mirrored, TPU, "
                                               r"MultiWorkerMirrored\) keeps every "
                                         r"variable whole, so mesh axis 'tensor'"):
        jd.strategies.LayoutPolicy(mesh=mesh3(), batch_axes=("data", "fsdp"))
    strategy = jd.ShardedStrategy(mesh=jax.make_mesh((2, 4), ("data", "fsdp")),
                                  batch_axes=("data", "fsdp"))
    with pytest.raises(ValueError,
                                         match=r"num_replicas_in_sync=8 \(the product of "
                                               r"batch_axes=\('data', 'fsdp'\)\) "
                                         r"does not divide global batch 12: drop the remainder "
                                         r"\(batch 8\) or pad"):
        strategy.experimental_distribute_values(np.zeros((12, 2), np.float32))


def test_a_model_axis_nothing_uses_is_reported():
    strategy = jd.ShardedStrategy(mesh=mesh3(), batch_axes=("data", "fsdp"), min_shard_size=1)
    with pytest.warns(jd.IdleAxisWarning,
                                                match=r"mesh axis 'tensor' \(size 2\).*splits none "
                                                      r"of the variables"
                                                r".* per device of them could be split 2 ways "
                                                r"along it"):
        strategy.create_variables(create_state, jax.random.key(0))


def test_a_user_mesh_of_explicit_axes_keeps_its_names_and_devices():
    mesh = mesh3((1, 4, 2))
    strategy = jd.ShardedStrategy(mesh=mesh, batch_axes=("data", "fsdp"),
                                  logical_axis_rules=LM1B_RULES)
    assert (strategy.mesh.axis_names == mesh.axis_names
            and (strategy.mesh.devices == mesh.devices).all())
    # unmodified steps compile on it
    assert set(strategy.mesh.axis_types) == {jax.sharding.AxisType.Auto}
    assert strategy.replica_devices == tuple(mesh.devices[0, :, 0])


def test_per_replica_values_come_back_in_replica_order_whatever_the_batch_axes_order():
    strategy = jd.ShardedStrategy(mesh=jax.make_mesh((2, 4), ("data", "fsdp")),
                                  batch_axes=("fsdp", "data"))
    ids = strategy.run(lambda: jd.get_replica_context().replica_id_in_sync_group * 1.0)
    assert [float(v) for v in strategy.experimental_local_results(ids)] == list(range(8))


def test_arrays_placed_on_the_users_own_mesh_enter_a_step():
    """The user's mesh is the strategy's, Explicit axes and all (jax.make_mesh's default): arrays
    the user placed on it enter a step as they are."""
    mesh = mesh3(axis_types=jax.sharding.AxisType.Explicit)
    assert jd.ShardedStrategy(mesh=mesh,
                              batch_axes=("data", "fsdp")).mesh.axis_types == mesh.axis_types
    strategy = jd.ShardedStrategy(mesh=mesh, batch_axes=("data", "fsdp"),
                                  logical_axis_rules=[("mlp", "tensor")])
    x = jax.device_put(np.ones((8, 4), np.float32),
                       jax.sharding.NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))
    w = jax.device_put(
        np.ones((4, 2), np.float32), jax.sharding.NamedSharding(mesh, PartitionSpec())
    )
    assert float(strategy.jit(lambda w, x: (x @ w).sum(), batch_argnums=(1,))(w, x)) == 64.0


def test_the_short_form_policy_keeps_a_model_axis_for_mirrored_variables():
    policy = jd.LayoutPolicy(jax.devices()[:8], 2)  # mirrored, on (replica, model) = (4, 2)
    assert dict(policy.mesh.shape) == {"replica": 4, "model": 2} and policy.num_replicas == 4
    assert policy.variable_layout("w", jax.ShapeDtypeStruct((8, 4),
                                                            "float32")).spec == PartitionSpec()


def test_policy_and_strategy_argument_errors_name_the_fix():
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
    with pytest.raises(ValueError, match=r"batch_axes=\('data',\) name axes of a mesh: pass mesh="):
        jd.LayoutPolicy(jax.devices()[:8], batch_axes=("data",))
    with pytest.raises(ValueError, match=r"LayoutPolicy needs devices= or mesh="):
        jd.LayoutPolicy()
    with pytest.raises(ValueError, match=r"mesh= and devices= / model_parallelism=1 both given"):
        jd.LayoutPolicy(jax.devices()[:8], mesh=mesh)
    with pytest.raises(ValueError, match=r"batch_axes=\(\) is empty"):
        jd.LayoutPolicy(mesh=mesh, batch_axes=(), split_variables=True)
    with pytest.raises(ValueError,
                       match=r"fsdp_axes='fsdp': a mirroring strategy keeps variables whole"):
        jd.LayoutPolicy(mesh=mesh, fsdp_axes="fsdp")
    with pytest.raises(ValueError,
                       match=r"batch_axes=3 must be a mesh axis name or a sequence of them"):
        jd.LayoutPolicy(mesh=mesh, batch_axes=3, split_variables=True)
    with pytest.raises(ValueError, match=r"MirroredStrategy got both devices= and mesh="):
        jd.MirroredStrategy(devices=jax.devices(), mesh=mesh)
    with pytest.raises(ValueError, match=r"TPUStrategy got mesh= with devices= / num_cores="):
        jd.TPUStrategy(mesh=mesh, num_cores=4)


def test_a_global_mesh_of_another_size_is_swapped_out_for_the_strategys_calls():
    """Flax's MiniGPT calls jax.set_mesh on 2 devices at import; a MirroredStrategy over 8 still
    runs its jit, run, on-device loop and plan on its own mesh (the user's mesh is JAX's context
    mesh again afterwards)."""
    user_mesh = jax.make_mesh((2,), ("batch",), devices=jax.devices()[:2])
    strategy = jd.MirroredStrategy(jax.devices()[:8])
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    with jax.set_mesh(user_mesh):
        w = strategy.mirror(np.ones(4, np.float32))
        step = strategy.jit(lambda w, x: w - 0.1 * x.mean(0), batch_argnums=1)
        np.testing.assert_allclose(step(w, x), 1 - 0.1 * x.mean(0), rtol=1e-6)
        # the steady-state path
        np.testing.assert_allclose(step(w, x), 1 - 0.1 * x.mean(0), rtol=1e-6)
        total = strategy.run(lambda w: jd.get_replica_context().all_reduce("sum", w), args=(w,))
        np.testing.assert_allclose(total, np.full(4, 8.0))
        ctx = strategy.run_steps_on_dataset(lambda ctx, t, b: t + b.sum(), iter([x, x]),
                                            iterations=2, initial_loop_values=np.float32(0))
        assert float(ctx.loop_values) == 2 * x.sum()
        assert step.plan(w, x).flops > 0
        # the user's, after each call
        assert dict(jax.sharding.get_abstract_mesh().shape) == {"batch": 2}

        @jax.jit
        def outer(w, x):  # inside another trace the context mesh cannot be swapped out
            return step(w, x)

        with pytest.raises(ValueError,
                           match=r"inside another jax\.jit while a mesh of 2 "
                                 r"devices.*strategy\.scope"):
            outer(w, x)


def test_every_role_is_one_entry_checked_the_same_way():
    # Each role of meshes.ROLES: its axes on a user's mesh must keep its relation to the batch axes,
    # a mirroring strategy refuses it, and an argument that is no role's is a TypeError naming the
    # roles' arguments.
    from jaxdist.strategies.layout import ROLES, LayoutPolicy, axis_roles, short_form_mesh

    m = jax.make_mesh((2, 4), ("data", "x"))
    for role in ROLES:
        batch = ("data", "x") if not role.batch else ("data",)  # the relation broken on purpose
        with pytest.raises(
            ValueError,
            match=rf"{role.argument}='x' names 'x', which is "
            rf"{'not in' if role.batch else 'also in'} batch_axes",
        ):
            axis_roles(m, batch, split=True, **{role.argument: "x"})
        if role.variables:  # a role that splits variables is refused by a mirroring strategy
            with pytest.raises(ValueError,
                               match=rf"{role.argument}='x': a mirroring strategy .* "
                                     rf"{role.short_form}=k"):
                axis_roles(m, ("data", "x") if role.batch else ("data",), split=False,
                           **{role.argument: "x"})
        else:  # context: sequences split, variables whole
            mirrored = axis_roles(m, ("data",), split=False, **{role.argument: "x"})
            assert mirrored.axes(role.name) == ("x",) and mirrored.fsdp_axes == ()
    with pytest.raises(TypeError,
                                        match=r"axis_roles\(\) got an unexpected keyword argument "
                                              r"'tensor_axes': the "
                                        r"roles' arguments are \['context_axes'"):
        axis_roles(m, ("data",), split=True, tensor_axes="x")
    with pytest.raises(TypeError,
                                        match=r"LayoutPolicy\(\) got an unexpected keyword "
                                              r"argument 'host_ofload': "
                                        r"besides the parameters it lists, it takes the roles' "
                                        r"arguments"):
        LayoutPolicy(jax.devices()[:8], host_ofload="params")
    with pytest.raises(TypeError, match=r"short_form_mesh\(\) got an unexpected keyword argument "
                                        r"'tensor_parallelism': the short forms are "
                                        r"\['context_parallelism'"):
        short_form_mesh(jax.devices()[:8], tensor_parallelism=2)
    # A mirroring strategy given a stage axis on its default batch axes: the mirroring error, not
    # the relation one.
    with pytest.raises(ValueError,
                       match=r"stage_axes='x': a mirroring strategy keeps every variable whole"):
        axis_roles(m, None, split=False, stage_axes="x")


def test_the_trainer_plans_an_lm1b_shaped_model_on_explicit_axes_before_its_first_step():
    """Before the first step, the plan builds the variables' shapes with the axis types
    create_variables runs the initializer with: Auto, where Flax's logical constraints do not
    type-check with the mesh's Explicit axes (jax.make_mesh's default)."""
    strategy = jd.ShardedStrategy(
        mesh=mesh3(axis_types=jax.sharding.AxisType.Explicit), batch_axes=("data", "fsdp"),
        fsdp_axes=("fsdp",), min_shard_size=1,
        logical_axis_rules=[*LM1B_RULES, ("batch", ("data", "fsdp"))], activation_axes=("batch",),
    )

    def loss_fn(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    tokens = data(steps=1)[0]["inputs"]
    batch = (tokens[:, :-1], tokens[:, 1:])
    trainer = jd.training.Trainer(strategy, CharLM(CONFIG), optax.adam(1e-3), loss_fn)
    planned = trainer.plan(batch)  # no state yet
    assert planned.flops > 0 and planned.state_bytes["params"] > 0
    trainer.train_on_batch(batch)
    assert trainer.plan(batch).state_bytes == planned.state_bytes  # the state it then created
