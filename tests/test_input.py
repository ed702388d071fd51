"""Distributed input: layouts, the divisibility error, per-process input functions, prefetch."""

import threading
import time

import jax
import numpy as np
import pytest
from registry import all_strategies, make

import jaxdist as jd


@all_strategies
def test_global_batches_are_split_over_replicas(strategy_name):
    strategy = make(strategy_name)
    n = strategy.num_replicas_in_sync
    data = [
        {"x": np.arange(4 * n * 3, dtype=np.float32).reshape(4 * n, 3) + i,
         "y": np.arange(4 * n) + i}
        for i in range(5)
    ]
    seen = list(strategy.experimental_distribute_dataset(data))
    assert len(seen) == 5
    for got, want in zip(seen, data, strict=True):
        for key in ("x", "y"):
            arr = got[key]
            assert isinstance(arr, jax.Array) and arr.sharding == strategy.batch_sharding
            np.testing.assert_array_equal(np.asarray(arr), want[key])
            # Each replica (all of its devices, with model parallelism) holds exactly its own rows.
            grid = strategy.mesh.devices.reshape(n, -1)
            for shard in arr.addressable_shards:
                replica = int(np.argwhere(grid == shard.device)[0][0])
                assert (shard.index[0].start or 0) == 4 * replica
                np.testing.assert_array_equal(np.asarray(shard.data),
                                              want[key][4 * replica : 4 * (replica + 1)])
    # A list is re-iterable: a second pass gives the same batches.
    assert len(list(strategy.experimental_distribute_dataset(data))) == 5


def test_indivisible_batch_says_drop_or_pad():
    strategy = jd.MirroredStrategy()
    with pytest.raises(ValueError,
                                          match=r"num_replicas_in_sync=8 does not divide global "
                                                r"batch 100: drop the "
                                          r"remainder \(batch 96\) or pad to 104"):
        list(strategy.experimental_distribute_dataset([np.zeros((100, 2))]))
    with pytest.raises(ValueError,
                                         match=r"the batch is ragged: its leaves have different "
                                               r"rows \(\[0\]: 16, \[1\]: "
                                         r"12\)"):
        # not a short batch
        strategy.experimental_distribute_values((np.zeros((16, 1)), np.zeros((12, 1))))
    # Fewer rows than replicas: no remainder to drop, the fix is more rows or fewer replicas.
    with pytest.raises(ValueError,
                                          match=r"does not divide global batch 5: each replica "
                                                r"needs at least one row: give "
                                          r"at least 8 rows .* or a strategy with fewer replicas"):
        list(strategy.experimental_distribute_dataset([np.zeros((5, 2))]))


def test_scalar_leaf_and_non_iterable_are_errors():
    strategy = jd.MirroredStrategy()
    with pytest.raises(ValueError, match=r"batch leaf \['step'\] is a scalar"):
        strategy.experimental_distribute_values({"x": np.zeros((8, 1)), "step": 3})
    with pytest.raises(TypeError, match=r"dataset=5 \(type int\) is not iterable"):
        strategy.experimental_distribute_dataset(5)
    with pytest.raises(TypeError, match=r"dataset_fn=.* is not callable"):
        strategy.distribute_datasets_from_function("data.npz")
    with pytest.raises(ValueError, match=r"prefetch=-1 must be an int >= 0"):
        strategy.experimental_distribute_dataset([], prefetch=-1)


def test_input_context_and_dataset_from_function():
    strategy = jd.MirroredStrategy()
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        per_host = ctx.get_per_replica_batch_size(64) * strategy.num_replicas_per_host
        return (np.full((per_host, 2), i, np.float32) for i in range(3))

    out = list(strategy.distribute_datasets_from_function(dataset_fn))
    assert contexts == [jd.InputContext(num_input_pipelines=1, input_pipeline_id=0,
                                        num_replicas_in_sync=8)]
    assert [b.shape for b in out] == [(64, 2)] * 3
    assert all(b.sharding == strategy.batch_sharding for b in out)
    with pytest.raises(ValueError, match="num_replicas_in_sync=8 does not divide global batch 60"):
        contexts[0].get_per_replica_batch_size(60)
    with pytest.raises(ValueError, match=r"input_pipeline_id=2 must be in \[0, 2\)"):
        jd.InputContext(num_input_pipelines=2, input_pipeline_id=2)
    with pytest.raises(ValueError, match="num_input_pipelines=0 must be >= 1"):
        jd.InputContext(num_input_pipelines=0)
    with pytest.raises(ValueError, match="num_replicas_in_sync=0 must be >= 1"):
        jd.InputContext(num_replicas_in_sync=0)
    with pytest.raises(ValueError, match="per-process batch 6"):
        list(strategy.distribute_datasets_from_function(lambda ctx: [np.zeros((6, 1))]))


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_errors_in_the_source_reach_the_consumer(prefetch):
    strategy = jd.MirroredStrategy()

    def source():
        yield np.zeros((8, 1))
        raise RuntimeError("reader failed at batch 2")

    it = iter(strategy.experimental_distribute_dataset(source(), prefetch=prefetch))
    assert next(it).shape == (8, 1)
    with pytest.raises(RuntimeError, match="reader failed at batch 2"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_failed_read_ends_a_prefetching_iterator_and_not_one_that_reads_on_demand(prefetch):
    """A source that fails once and then reads on: read on demand, the next call reads it again;
    read by the prefetch thread, the thread's reading ended with the error, and so did the
    iterator."""
    strategy = jd.MirroredStrategy()

    class FailsOnce:
        def __init__(self):
            self.calls = 0

        def __iter__(self):
            return self

        def __next__(self):
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("one bad read")
            if self.calls > 3:
                raise StopIteration
            return np.full((8, 1), self.calls, np.float32)

    it = iter(strategy.experimental_distribute_dataset(FailsOnce(), prefetch=prefetch))
    assert float(next(it)[0, 0]) == 1.0
    with pytest.raises(RuntimeError, match="one bad read"):
        next(it)
    if prefetch == 0:
        assert float(next(it)[0, 0]) == 3.0
    with pytest.raises(StopIteration):
        next(it)


def test_prefetch_runs_ahead_and_close_stops_the_thread():
    strategy = jd.MirroredStrategy()
    pulled = []

    def source():
        for i in range(1000):
            pulled.append(i)
            yield np.full((8, 1), i, np.float32)

    it = iter(strategy.experimental_distribute_dataset(source(), prefetch=2))
    first = next(it)
    assert float(first[0, 0]) == 0.0
    deadline = time.monotonic() + 10
    while len(pulled) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(pulled) >= 3  # batches 1 and 2 were placed ahead while the consumer did nothing
    time.sleep(0.2)
    assert len(pulled) <= 5  # ... but no further than the prefetch depth allows
    it.close()
    assert not any(t.name == "jaxdist-prefetch" and t.is_alive() for t in threading.enumerate())
    with pytest.raises(StopIteration):
        next(it)


def test_device_resident_batches_pass_through():
    strategy = jd.MirroredStrategy()
    placed = strategy.experimental_distribute_values(np.ones((8, 2), np.float32))
    (again,) = list(strategy.experimental_distribute_dataset([placed]))
    assert again is placed  # already in the batch layout: no copy
    on_one_device = jax.device_put(np.ones((8, 2), np.float32), jax.devices()[3])
    moved = strategy.experimental_distribute_values(on_one_device)
    assert moved.sharding == strategy.batch_sharding
