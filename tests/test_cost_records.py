"""One home for plans and costs: one byte and one FLOP formatter, one per-device byte count, one
name per field, and the Trainer's `StepCost` read from the plan of its train step."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist as jd
from jaxdist.costs.plan import read_plan


def test_one_byte_formatter_and_one_flop_formatter_everywhere():
    f = jd.costs.format_bytes
    assert [f(0), f(12), f(1536), f(3 * 2**20), f(1000 * 1024), f(80 * 2**30)] == [
        "0 B", "12 B", "1.5 KiB", "3 MiB", "1000 KiB", "80 GiB"]
    assert (jd.costs.format_flops(989.4e12) == "989 TFLOP"
            and jd.costs.format_flops(1.5e3) == "1.5 kFLOP")


def test_the_layout_warning_prints_bytes_with_the_one_formatter():
    mesh = jax.make_mesh((4, 2), ("replica", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    strategy = jd.ShardedStrategy(mesh=mesh, batch_axes="replica", min_shard_size=1)
    # w: a quarter (4 KiB) on each device
    w, x = np.ones((64, 64), np.float32), np.ones((8, 64), np.float32)
    with pytest.warns(jd.IdleAxisWarning,
                      match=r"; 4 KiB per device of them could be split 2 ways"):
        strategy.jit(lambda w, x: x @ w, batch_argnums=1)(w, x)


def test_one_per_device_byte_count_counts_the_largest_shard():
    mesh = jax.make_mesh((8,), ("data",))
    uneven = jax.ShapeDtypeStruct((10, 4), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    assert jd.costs.bytes_per_device(uneven) == 2 * 4 * 4  # ceil(10 / 8) rows on the fullest device
    placed = jax.device_put(np.ones((16, 4), np.float32), NamedSharding(mesh, P("data")))
    key = jax.random.key(0)  # a typed PRNG key: its dtype knows its size
    assert jd.costs.bytes_per_device({"a": placed, "k": key, "n": None,
                                      "i": 3}) == 2 * 4 * 4 + key.dtype.itemsize
    shard = max(s.data.nbytes for s in placed.addressable_shards)  # what the runtime holds
    assert jd.costs.bytes_per_device(placed) == shard


def test_plan_and_step_cost_share_the_field_names():
    compiled = jax.jit(lambda a, b: a @ b).lower(jnp.ones((8, 4)), jnp.ones((4, 2))).compile()
    plan = read_plan(compiled, state_bytes={"params": 32})
    assert (
        plan.unknown_loops == 0 and not plan.lower_bound and plan.model_flops == plan.flops == 128.0
    )
    cost = jd.training.StepCost.of_plan(plan, options=jd.costs.step.CostOptions(),
                                        devices=jax.devices()[:1],
                                        local_devices=jax.devices()[:1], rows_per_step=8)
    for name in ("flops", "model_flops", "temp_bytes", "unknown_loops", "uncosted", "lower_bound"):
        assert getattr(cost, name) == getattr(plan, name), name
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert str(plan).startswith("Plan for mesh {'devices': 1} (1 devices), planned in")


def test_read_plan_of_text_needs_the_memory_analysis():
    text = jax.jit(lambda a: a * 2).lower(jnp.ones(4)).compile().as_text()
    with pytest.raises(ValueError, match=r"read_plan\(program=<text>\) needs memory="):
        read_plan(text)
    assert read_plan(text, memory={"temp_size_in_bytes": 8}).temp_bytes == 8


def test_the_trainers_step_cost_is_read_from_the_plan_of_its_train_step():
    trainer = jd.training.Trainer(jd.ShardedStrategy(min_shard_size=1), nn.Dense(16),
                                  optax.adam(1e-3), lambda out, y: ((out[:, 0] - y) ** 2).mean())
    batch = (np.ones((16, 16), np.float32), np.ones(16, np.float32))
    trainer.train_on_batch(batch)
    cost = trainer.step_cost()
    assert isinstance(cost.plan, jd.Plan)
    assert cost.flops == cost.plan.flops == trainer.plan(batch).flops
    assert (cost.param_bytes == cost.plan.state_bytes["params"]
            == jd.costs.bytes_per_device(trainer.state.params))
    assert cost.optimizer_bytes == jd.costs.bytes_per_device(trainer.state.opt_state) > 0
    assert cost.param_bytes == (16 * 16 + 16) * 4 // 8  # FSDP over 8 devices: an eighth each
    assert cost.temp_bytes == cost.plan.temp_bytes
