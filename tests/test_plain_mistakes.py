"""Plain mistakes get errors that name the argument, what was received and the fix, before JAX or
orbax meet them: text in a batch, a ragged batch (its leaves' rows differ: not a short batch), a
numpy state to restore into, a checkpoint directory that cannot be made or written.
"""

from __future__ import annotations

import errno
import os

import flax.linen as nn
import numpy as np
import optax
import pytest

import jaxdist as jd
from jaxdist.training.checkpoints import _storage as checkpoint_storage

X = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)


def trainer():
    return jd.training.Trainer(
        jd.MirroredStrategy(),
        nn.Dense(2),
        optax.sgd(0.1),
        lambda o, y: optax.softmax_cross_entropy_with_integer_labels(o, y).mean(),
    )


@pytest.mark.parametrize(("batch", "leaf"), [
    ((X, np.array(["cat"] * 64)), "y"),
    (({"image": X, "caption": np.array(["a"] * 64, object)}, np.zeros(64, np.int32)),
     r"x\['caption'\]"),
])
def test_text_in_a_training_batch_is_named(batch, leaf):
    with pytest.raises(TypeError,
                                        match=rf"train_data batch 0 of epoch 0 leaf {leaf} holds "
                                              r"text or objects \(numpy "
                                        r"dtype .*\): JAX arrays hold numbers and bools only\. "
                                        r"Encode it"):
        trainer().fit([batch], steps=1, verbose=0)


def test_text_or_a_ragged_batch_through_the_strategy_is_named():
    strategy = jd.MirroredStrategy()
    assert strategy.num_replicas_in_sync == 8
    ragged = (X, np.zeros(60, np.int32))
    said = (r"is ragged: its leaves have different rows \(\[0\]: 64, \[1\]: 60\), and axis 0 of "
            r"every leaf is the batch the 8 replicas split\. Give every leaf the same rows")
    with pytest.raises(ValueError, match=rf"^the batch {said}"):
        next(iter(strategy.experimental_distribute_dataset([ragged])))
    step = strategy.jit(lambda w, b: (w, b[0].sum()), batch_argnums=(1,))
    with pytest.raises(ValueError, match=rf"^argument 1 \(in batch_argnums\) {said}"):
        step(np.zeros(3, np.float32), ragged)
    with pytest.raises(TypeError,
                                        match=r"^argument 1 \(in batch_argnums\) leaf \[1\] holds "
                                              r"text or objects \(numpy "
                                        r"dtype <U1\)"):
        step(np.zeros(3, np.float32), (X, np.array(["a"] * 64)))
    with pytest.raises(ValueError, match=rf"^args\[1\] of strategy.run {said}"):
        strategy.run(lambda w, b: b[0].sum(), args=(np.zeros(3, np.float32), ragged),
                     batch_argnums=(1,))
    # Leaves of different rows that the replicas all divide are still split, each on its own (as
    # before).
    x, w = next(iter(strategy.experimental_distribute_dataset([(X, np.zeros(16, np.float32))])))
    assert x.shape == (64, 4) and w.shape == (16,)


def test_restoring_into_numpy_arrays_names_the_leaf_and_the_fix(tmp_path):
    with jd.training.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": np.zeros(4, np.float32)})
        with pytest.raises(TypeError,
                                            match=r"^like\['w'\] is a numpy\.ndarray \(shape "
                                                  r"\(4,\), float32\), which says "
                                            r"no layout to restore into: pass the state in the "
                                            r"layout to restore "
                                            r"onto \(e\.g\. like=strategy\.mirror\(host_state\)"):
            ckpt.restore({"w": np.zeros(4, np.float32)})
        restored, _ = ckpt.restore(jd.OneDeviceStrategy().mirror({"w": np.zeros(4, np.float32)}))
        assert restored["w"].shape == (4,)


def test_a_checkpointer_on_a_directory_it_cannot_make_or_write_says_so(tmp_path, monkeypatch):
    def read_only(*args, **kwargs):  # root ignores permission bits: refuse the call itself
        raise OSError(errno.EROFS, "Read-only file system")

    with monkeypatch.context() as patch:
        patch.setattr(os, "makedirs", read_only)
        with pytest.raises(ValueError,
                                             match=r"^directory='.*new' cannot be created \(the "
                                                   r"directory it would be made "
                                             r"in is not writable; OSError: Read-only file "
                                             r"system\): make it writable"):
            jd.training.Checkpointer(tmp_path / "new")
    # an existing read-only directory opens (to restore from)
    ckpt = jd.training.Checkpointer(tmp_path / "ro")
    monkeypatch.setattr(checkpoint_storage, "open", read_only, raising=False)
    with pytest.raises(ValueError,
                                         match=r"^directory='.*ro' cannot hold checkpoints \(it is "
                                               r"not writable; OSError: "
                                         r"Read-only file system\): make it writable.*Nothing was "
                                         r"saved\.$"):
        ckpt.save(1, {"w": np.zeros(2, np.float32)})
    ckpt.close()
