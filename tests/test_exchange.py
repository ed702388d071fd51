"""The ragged token exchange: the CPU emulation follows `jax.lax.ragged_all_to_all`'s documented
semantics, the exchange plan groups what each device receives and brings it back, and the real
collective's path lowers for GPU and TPU (XLA:CPU has no ragged all-to-all, so it cannot run here;
`jax.export` lowers it for them).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import PartitionSpec as P

from jaxdist.nn import experts
from jaxdist.nn.exchange import exchange, exchange_plan, has_ragged_exchange, ragged_all_to_all

pytestmark = pytest.mark.timeout(300)


def _mesh(n):
    return jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:n])


def _per_device(fn, n, *args):
    """``fn`` on each of ``n`` devices' rows of ``args`` (each ``(n, ...)``): the stacked
    results."""
    mapped = jax.shard_map(lambda *a: fn(*(v[0] for v in a))[None], mesh=_mesh(n), in_specs=P("x"),
                           out_specs=P("x"))
    return np.asarray(jax.jit(mapped)(*(jnp.asarray(a) for a in args)))


def test_the_emulation_gives_the_collectives_documented_example():
    # jax.lax.ragged_all_to_all's docstring: an axis of size 2, one slice per device.
    operand = [[1, 2, 2], [3, 4, 0]]
    output = [[0, 0, 0, 0], [0, 0, 0, 0]]
    input_offsets, send_sizes = [[0, 1], [0, 1]], [[1, 2], [1, 1]]
    output_offsets, recv_sizes = [[0, 0], [1, 2]], [[1, 1], [2, 1]]

    def fn(*a):
        return ragged_all_to_all(*a, axis_name="x", native=False, slice_rows=3)

    got = _per_device(fn, 2, np.float32(operand), np.float32(output), *(np.int32(a) for a in (
        input_offsets, send_sizes, output_offsets, recv_sizes)))
    np.testing.assert_array_equal(got, [[1, 3, 0, 0], [2, 2, 4, 0]])


def test_the_plan_groups_received_rows_by_slot_and_the_way_back_restores_them():
    # 2 devices x 2 slots (e.g. experts 0, 1 on device 0 and 2, 3 on device 1); rows sorted by
    # slice.
    # device 0 sends 2 rows to expert 0, 0 to 1, 1 to 2, 3 to 3
    sizes = np.int32([[2, 0, 1, 3], [1, 2, 0, 1]])
    rows = np.float32([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 0, 0]])

    def there_and_back(sizes, rows):
        plan = exchange_plan(sizes, "x")
        got = exchange(rows[:, None], jnp.zeros((8, 1)), plan, axis_name="x", native=False,
                       slice_rows=6)
        back = exchange(got, jnp.zeros_like(rows[:, None]), plan.back(), axis_name="x",
                        native=False, slice_rows=6)
        return jnp.concatenate([got[:, 0], jnp.float32(plan.group_sizes), back[:, 0]])

    out = _per_device(there_and_back, 2, sizes, rows)
    received, groups, back = out[:, :8], out[:, 8:10], out[:, 10:]
    # Device 0 holds experts 0, 1: expert 0 gets [10, 11] from device 0 then [20] from device 1;
    # expert 1: [21, 22].
    np.testing.assert_array_equal(received[0], [10, 11, 20, 21, 22, 0, 0, 0])
    # expert 2: [12]; 3: [13, 14, 15], [23]
    np.testing.assert_array_equal(received[1], [12, 13, 14, 15, 23, 0, 0, 0])
    np.testing.assert_array_equal(groups, [[3, 2], [1, 4]])
    np.testing.assert_array_equal(back, [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 0, 0]])


def test_expert_parallel_ragged_dispatch_lowers_for_gpu_and_tpu():
    # The real collective's path (native=True), gradients included: lowered for the accelerators
    # that run it.
    config = experts.Routing(num_experts=8, top_k=2)
    weights = experts.init_weights(jax.random.key(0), config, 16, 32)
    x = jax.random.normal(jax.random.key(1), (8, 8, 16))
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    specs = experts.Weights(P(), P("expert"), P("expert"), P("expert"), None)

    def loss(w, x):
        def local(w, x):
            return experts._ragged_local(config, w, x, ("expert",), ("data", "expert"), True)

        y, _ = jax.shard_map(local, mesh=mesh, in_specs=(specs, P(("data", "expert"))),
                             out_specs=(P(("data", "expert")), (P(),) * 5))(w, x)
        return jnp.sum(y ** 2)

    exported = export.export(
        jax.jit(jax.grad(loss, argnums=(0, 1))),
        platforms=("cuda", "rocm", "tpu"),
        disabled_checks=[export.DisabledSafetyCheck.custom_call("ragged_all_to_all")],
    )(weights, x)
    module = exported.mlir_module()
    # Forward: there and back; backward: each transposed.
    assert module.count("@ragged_all_to_all(") >= 4, module.count("@ragged_all_to_all(")
    assert "ragged_dot" in module
    assert all(has_ragged_exchange(p) for p in ("gpu", "tpu")) and not has_ragged_exchange("cpu")
    assert has_ragged_exchange("tpu", "TPU v5 lite") and not has_ragged_exchange("tpu", "TPU v3")


def test_a_plan_whose_slices_the_devices_do_not_divide_is_an_error():
    with pytest.raises(ValueError,
                                         match=r"send_sizes has 3 slices, which the 2 devices of "
                                               r"axis_name='x' do not "
                                         r"divide: .* pad send_sizes with zeros"):
        _per_device(lambda sizes: exchange_plan(sizes, "x").send_offsets, 2,
                    np.int32([[1, 2, 3], [1, 2, 3]]))
