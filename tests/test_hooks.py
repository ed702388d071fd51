"""Layout hooks: a strategy subclass's ``variable_layout`` / ``layout_role`` decide for every
internal caller."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist as jd


class WholeBiases(jd.ShardedStrategy):
    """FSDP, except that every variable named ``bias`` stays whole on every device."""

    def variable_layout(self, path, aval, annotation=None):
        if path.endswith("bias"):
            return NamedSharding(self.mesh, P())
        return super().variable_layout(path, aval, annotation)


def _params():
    return {"bias": np.ones(64, np.float32), "kernel": np.ones((64, 8), np.float32)}


def test_variable_layout_override_reaches_every_caller():
    strategy = WholeBiases(min_shard_size=1)
    created = strategy.create_variables(lambda: jax.tree.map(jnp.asarray, _params()))
    mirrored = strategy.mirror(_params())
    assert created["bias"].sharding.spec == P() and mirrored["bias"].sharding.spec == P()
    assert created["kernel"].sharding.spec != P()  # the strategy's own rule for the rest
    assert strategy.variable_shardings(_params())["bias"].spec == P()
    # unplaced arguments of jit and outputs given the variable layout
    step = strategy.jit(lambda p, x: ({"bias": p["bias"] + x.sum()}, p), batch_argnums=1)
    new_bias, same = step(_params(), np.ones((8, 2), np.float32))
    assert new_bias["bias"].sharding.spec == P() and same["bias"].sharding.spec == P()
    assert same["kernel"].sharding.spec == created["kernel"].sharding.spec


def test_the_base_strategy_does_not_install_a_hook():
    strategy = jd.ShardedStrategy(min_shard_size=1)
    assert strategy._policy._variable_hook is None and strategy._policy._role_hook is None


class NothingIsABatch(jd.MirroredStrategy):
    """A strategy whose layouts say no placed value is a batch (every one reaches each replica
    whole)."""

    def layout_role(self, x):
        return None if super().layout_role(x) is None else "variable"


def test_layout_role_override_decides_what_run_splits():
    plain, custom = jd.MirroredStrategy(), NothingIsABatch()
    rows = lambda x: jnp.float32(x.shape[0])  # noqa: E731
    for strategy, expected in ((plain, 16 // plain.num_replicas_in_sync), (custom, 16)):
        x = strategy.experimental_distribute_values(np.ones((16, 2), np.float32))
        assert strategy.layout_role(x) == ("batch" if strategy is plain else "variable")
        out = strategy.run(rows, args=(x,))
        assert float(strategy.experimental_local_results(out)[0]) == expected


def test_strategy_and_policy_agree_on_a_dataset_batch_on_fsdp():
    strategy = jd.ShardedStrategy(min_shard_size=1)
    batch = next(
        iter(strategy.experimental_distribute_dataset([np.ones((16, 2), np.float32)], prefetch=0))
    )
    w = strategy.mirror(np.ones((16, 4), np.float32))
    assert strategy.layout_role(batch) == strategy._policy.layout_role(batch) == "batch"
    assert strategy.layout_role(w) is None and strategy._policy.layout_role(w) is None


class WholeLabels(jd.MirroredStrategy):
    """Batches split as usual, except rank-1 leaves (labels), which every device holds whole."""

    def batch_layout(self, shape):
        if len(shape) == 1:
            return NamedSharding(self.mesh, P())
        return super().batch_layout(shape)


def test_batch_layout_override_reaches_every_caller():
    strategy = WholeLabels()
    x, y = np.ones((16, 3), np.float32), np.arange(16, dtype=np.float32)
    placed = strategy.experimental_distribute_values((x, y))
    assert placed[0].sharding.spec == P("replica") and placed[1].sharding.spec == P()
    from_dataset = next(iter(strategy.experimental_distribute_dataset([(x, y)], prefetch=0)))
    assert from_dataset[1].sharding.spec == P()
    step = strategy.jit(lambda w, b: (w * b[0]).sum() + b[1].sum(), batch_argnums=1)
    np.testing.assert_allclose(float(step(np.float32(2.0), (x, y))), 2.0 * 48 + 120.0)
    assert strategy.batch_layout((16,)).spec == P() and strategy.batch_layout((16, 3)).spec == P(
        "replica"
    )
