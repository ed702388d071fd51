"""Bring your own run: ``Trainer.load_state`` continues a run trained in plain JAX and saved with
plain orbax.

The reference is a plain-JAX run (``jax.jit`` on one device, Adam with a warmup-cosine schedule) of
30 steps, saved with plain orbax at step 20. Trainers on MirroredStrategy and ShardedStrategy (FSDP)
load that checkpoint and train steps 21-30: their losses and parameters equal the plain run's. The
state is born in the strategy's layout, a state that does not fit is a ValueError naming the leaf,
and a foreign checkpoint directory is met with the two lines of orbax that read it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from registry import CLASSES, FEATURES, LAUNCH, assert_variable_layout, launch_env, make

import jaxdist as jd

STEPS, SAVED, ROWS = 30, 20, 32


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(CLASSES)(nn.relu(nn.Dense(16)(x)))


class BatchNormMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.BatchNorm(use_running_average=not train)(nn.Dense(16)(x))
        return nn.Dense(CLASSES)(nn.relu(x))


def ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def optimizer():
    # eps = the peak rate: well-conditioned Adam, so another summation order stays rounding noise
    # (registry.adam)
    return optax.adam(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, STEPS), eps=1e-2)


def batches():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS, ROWS, FEATURES)).astype(np.float32)
    return [(x[i], x[i, :, :CLASSES].argmax(1).astype(np.int32)) for i in range(STEPS)]


def assert_close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b)),
                    strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def plain(steps, at_save=None):
    """A plain-JAX run (``jax.jit`` on one device) of ``steps`` steps; ``at_save(params,
    opt_state)`` is called before step ``SAVED``. Returns the parameters, the optimizer state and
    the losses."""
    model, tx, data = MLP(), optimizer(), batches()
    params = model.init(jax.random.key(0), data[0][0][:1])["params"]
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: ce(model.apply({"params": p}, x), y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for step, (x, y) in enumerate(data[:steps]):
        if step == SAVED and at_save is not None:
            at_save(params, opt_state)
        params, opt_state, loss = train_step(params, opt_state, x, y)
        losses.append(float(loss))
    return params, opt_state, np.array(losses)


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """The plain run of ``STEPS`` steps; its state at step ``SAVED`` saved with plain orbax
    (CheckpointManager and StandardSave, as orbax's own recipe does). Returns the directory, the
    losses of the steps after ``SAVED`` and the final parameters."""
    directory = tmp_path_factory.mktemp("plain") / "checkpoints"

    def save(params, opt_state):
        with ocp.CheckpointManager(directory) as manager:
            manager.save(SAVED, args=ocp.args.StandardSave({"params": params,
                                                            "opt_state": opt_state}))

    params, _, losses = plain(STEPS, save)
    return directory, losses[SAVED:], params


def read_plain(directory, with_target):
    """The saved state as a migrating user reads it with plain orbax: into the structure
    ``optimizer.init`` gives (with a target), or as orbax has it (without one: the optax NamedTuples
    as dicts, tuples as lists)."""
    path = directory / str(SAVED) / "default"
    if not with_target:
        return ocp.StandardCheckpointer().restore(path)
    params = MLP().init(jax.random.key(0), np.ones((1, FEATURES), np.float32))["params"]
    target = jax.eval_shape(lambda: {"params": params, "opt_state": optimizer().init(params)})
    return ocp.StandardCheckpointer().restore(path, target)


def linen_trainer(strategy, model=None, tx=None):
    return jd.training.Trainer(strategy, model or MLP(), tx or optimizer(), ce)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("strategy_name", "with_target"), [("mirrored_8", True),
                                                            ("sharded_8", False)])
def test_a_plain_orbax_run_continues_equal_to_the_plain_run(plain_run, strategy_name, with_target):
    directory, losses, final = plain_run
    strategy = make(strategy_name)
    state = read_plain(directory, with_target)
    data = batches()
    trainer = linen_trainer(strategy)
    loaded = trainer.load_state(params=state["params"], opt_state=state["opt_state"], step=SAVED,
                                batch=data[0])
    assert trainer.step == SAVED and int(loaded.step) == SAVED
    assert_variable_layout(strategy, loaded, "the loaded state")
    # born split: each device holds its part of a split leaf, not the whole
    if strategy_name == "sharded_8":
        for leaf in (loaded.params["Dense_0"]["kernel"],
                     loaded.opt_state[0].mu["Dense_0"]["kernel"]):
            part = leaf.sharding.shard_shape(leaf.shape)
            assert np.prod(part) < leaf.size
            assert {s.data.shape for s in leaf.addressable_shards} == {part}
    # the plain run read batch 20 next: an iterator over the rest is read on
    history = trainer.fit(iter(data[SAVED:]), steps=STEPS, log_every=1, verbose=0)
    got = np.array([row["loss"] for row in history.train])
    np.testing.assert_allclose(got, losses, rtol=1e-5)
    assert_close(trainer.params, final)
    assert trainer.step == STEPS and int(trainer.state.opt_state[0].count) == STEPS
    assert_variable_layout(strategy, trainer.state, "the state after fit")


@pytest.mark.timeout(300)
def test_restore_and_fit_of_a_foreign_checkpoint_name_load_state(plain_run, tmp_path):
    directory, _, _ = plain_run
    data = batches()
    trainer = linen_trainer(make("one_device"))
    item = str(directory / str(SAVED) / "default")
    lines = [
        f"    state = ocp.StandardCheckpointer().restore({item!r})\n",
        "    trainer.load_state(params=state['params'], opt_state=state['opt_state'], "
        f"step={SAVED})\n",
    ]
    with pytest.raises(ValueError, match="did not write") as restored:
        trainer.restore(directory, batch=data[0])
    with pytest.raises(ValueError, match="did not write") as fitted:
        trainer.fit(data, steps=2, checkpoint_dir=directory, verbose=0)
    for error in (restored, fitted):
        message = str(error.value)
        assert all(line in message for line in lines), message
        assert ("empty directory" not in message
                and "its tree's top: ['opt_state', 'params']" in message)
    # nothing written
    assert trainer.state is None and sorted(p.name for p in directory.iterdir()) == [str(SAVED)]
    # The two lines, run as shown, continue the run.
    state = ocp.StandardCheckpointer().restore(item)
    trainer.load_state(params=state["params"], opt_state=state["opt_state"], step=SAVED,
                       batch=data[0])
    assert trainer.step == SAVED

    # One StandardCheckpointer directory (no steps): restore and fit say the same, with its path.
    single = tmp_path / "single"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(single, {"params": state["params"]})
    for call in (lambda t: t.restore(single, batch=data[0]),
                 lambda t: t.fit(data, steps=2, checkpoint_dir=single, verbose=0)):
        with pytest.raises(
            ValueError, match=r"holds an orbax checkpoint that jaxdist\.training did not write"
        ) as e:
            call(linen_trainer(make("one_device")))
        assert f"ocp.StandardCheckpointer().restore({str(single)!r})" in str(e.value)
        assert "trainer.load_state(params=state['params'])" in str(e.value)


def plain_state(model=None, tx=None):
    """A plain run's parameters and optimizer state (host arrays), as a user has them."""
    model = model or MLP()
    variables = model.init(jax.random.key(0), np.ones((1, FEATURES), np.float32))
    return jax.device_get(variables), jax.device_get((tx or optimizer()).init(variables["params"]))


@pytest.mark.timeout(300)
def test_a_state_that_does_not_fit_is_an_error_naming_the_leaf():
    data = batches()
    params = plain_state()[0]["params"]
    trainer = linen_trainer(make("mirrored_8"))
    wrong_params = [
        ({"Dense_0": params["Dense_0"]},
         r"params\['Dense_1'\]\['bias'\] \(\(16,\) float32\) is missing"),
        ({**params, "Dense_9": params["Dense_0"]},
         r"params\['Dense_9'\]\['bias'\] \(\(4,\) float32\) is extra"),
        ({**params, "Dense_0": {**params["Dense_0"], "kernel": np.zeros((32, 4), np.float32)}},
         r"params\['Dense_0'\]\['kernel'\] is \(32, 4\) float32 where the trainer has \(16, 4\) "
         r"float32"),
        (jax.tree.map(lambda a: a.astype(np.float64), params),
         r"params\['Dense_0'\]\['bias'\] is \(4,\) float64"),
        ({**params, "Dense_1": {**params["Dense_1"], "bias": "zeros"}},
         r"params\['Dense_1'\]\['bias'\] is a str, not an array"),
    ]
    for wrong, match in wrong_params:
        with pytest.raises(
            ValueError, match=r"params does not fit this trainer's model and optimizer: .*" + match
        ):
            trainer.load_state(params=wrong, batch=data[0])
    with pytest.raises(ValueError,
                                         match=r"opt_state\[0\]\.mu\['Dense_0'\]\['bias'\] "
                                               r"\(\(4,\) float32\) is "
                                         r"missing.*Fix: pass the state of the optimizer the "
                                         r"Trainer was given"):
        trainer.load_state(params=params, opt_state=optax.sgd(0.1, momentum=0.9).init(params),
                           batch=data[0])
    with pytest.raises(ValueError,
                       match=r"model_state\['batch_stats'\]\['mean'\] \(\(2,\) float32\) is extra"):
        trainer.load_state(params=params,
                           model_state={"batch_stats": {"mean": np.zeros(2, np.float32)}},
                           batch=data[0])
    with pytest.raises(ValueError,
                                         match=r"params holds two leaves named 'Dense_0/bias' "
                                               r"\(\['Dense_0'\]\['bias'\] "
                                         r"and \['Dense_0/bias'\]\).*pass one of them"):
        trainer.load_state(params={**params, "Dense_0/bias": params["Dense_0"]["bias"]},
                           batch=data[0])
    with pytest.raises(ValueError, match=r"step=-1 must be an int >= 0"):
        trainer.load_state(params=params, step=-1, batch=data[0])
    assert trainer.state is None and trainer.step == 0  # every error left the trainer as it was
    with pytest.raises(TypeError,
                       match=r"data_position=\(0, 20\) must be a jd\.training\.DataPosition"):
        trainer.data_position = (0, 20)


@pytest.mark.timeout(300)
def test_the_step_and_the_optimizer_count_disagreeing_is_said():
    data = batches()
    variables, opt_state = plain_state()
    # a run of 7 steps
    counted = jax.tree.map(lambda a: a + 7 if a.dtype == np.int32 else a, opt_state)
    trainer = linen_trainer(make("one_device"))
    with pytest.warns(UserWarning,
                                         match=r"optimizer state counts opt_state\[0\]\.count = 7, "
                                               r"opt_state\[1\]\.count "
                                         r"= 7 while the trainer's step is 0: .*pass step=7"):
        trainer.load_state(params=variables["params"], opt_state=counted, batch=data[0])
    with pytest.warns(UserWarning,
                                         match=r"the optimizer state is a fresh one "
                                               r"\(opt_state\[0\]\.count = 0.* while "
                                         r"the step is 7: its schedule and moments start over"):
        trainer.load_state(params=variables["params"], step=7)
    trainer.load_state(params=variables["params"], opt_state=counted, step=7)  # they agree: silent
    assert trainer.step == 7 and int(trainer.state.step) == 7


@pytest.mark.timeout(300)
def test_fit_after_load_state_says_where_a_list_is_read_from(plain_run, tmp_path):
    directory, losses, final = plain_run
    data = batches()
    state = read_plain(directory, with_target=True)

    def loaded():
        trainer = linen_trainer(make("one_device"))
        trainer.load_state(params=state["params"], opt_state=state["opt_state"], step=SAVED,
                           batch=data[0])
        return trainer

    trainer = loaded()
    with pytest.warns(UserWarning,
                                         match=r"fit continues the run load_state loaded at step "
                                               r"20 from batch 0 of epoch "
                                         r"0 of train_data.*DataPosition\(epoch=0, index=20\)"):
        # the batches that come next: fine, but said
        trainer.fit(data[SAVED:], steps=SAVED + 1, verbose=0)
    trainer = loaded()  # a checkpoint_dir holding a later step: fit resumes from it, and says so
    other = linen_trainer(make("one_device"))
    other.fit(data, steps=SAVED + 2, checkpoint_dir=tmp_path / "later", verbose=0)
    with pytest.warns(UserWarning,
                                         match=r"fit resumes from checkpoint 22 of "
                                               r"checkpoint_dir=.*which replaces the "
                                         r"state load_state gave \(step 20\)"):
        trainer.fit(data, steps=SAVED + 3, checkpoint_dir=tmp_path / "later", verbose=0)
    assert trainer.step == SAVED + 3
    # the whole run's batches, and where it stopped: silent, and equal to the plain run
    trainer = loaded()
    trainer.data_position = jd.training.DataPosition(epoch=0, index=SAVED)
    history = trainer.fit(data, steps=STEPS, log_every=1, verbose=0)
    np.testing.assert_allclose([row["loss"] for row in history.train], losses, rtol=1e-5)
    assert_close(trainer.params, final)


class NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(FEATURES, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.out = nnx.Linear(16, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.norm(self.hidden(x))))


@pytest.mark.timeout(300)
def test_an_nnx_run_saved_with_plain_orbax_continues_equal(tmp_path):
    data = batches()
    model = NnxNet(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optimizer(), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(lambda m: ce(m(x), y))(model)
        opt.update(model, grads)
        return loss

    losses = []
    for step, (x, y) in enumerate(data):
        if step == SAVED:  # saved as nnx states, with plain orbax
            with ocp.StandardCheckpointer() as checkpointer:
                checkpointer.save(
                    tmp_path / "nnx",
                    {
                        "params": nnx.state(model, nnx.Param),
                        "model_state": nnx.state(model, nnx.Not(nnx.Param)),
                        "opt_state": opt.opt_state,
                    },
                )
        losses.append(float(train_step(model, opt, x, y)))

    # no target: each Variable's value under "value"
    saved = ocp.StandardCheckpointer().restore(tmp_path / "nnx")
    strategy = make("sharded_8")
    mine = NnxNet(nnx.Rngs(1))  # other initial values: all of them come from the checkpoint
    trainer = jd.training.Trainer(strategy, mine, optimizer(), ce)
    loaded = trainer.load_state(params=saved["params"], opt_state=saved["opt_state"], step=SAVED,
                                model_state=saved["model_state"])
    assert_variable_layout(strategy, loaded, "the loaded nnx state")
    np.testing.assert_array_equal(np.asarray(mine.norm.mean[...]),
                                  saved["model_state"]["norm"]["mean"]["value"])
    history = trainer.fit(iter(data[SAVED:]), steps=STEPS, log_every=1, verbose=0)
    np.testing.assert_allclose([row["loss"] for row in history.train], losses[SAVED:], rtol=1e-5)
    assert_close(nnx.state(mine, nnx.Param), nnx.state(model, nnx.Param))
    assert_close(nnx.state(mine, nnx.BatchStat), nnx.state(model, nnx.BatchStat))


@pytest.mark.timeout(300)
def test_a_linen_model_state_is_loaded_or_built_as_init_builds_it():
    data = batches()
    variables, opt_state = plain_state(BatchNormMLP())
    stats = jax.tree.map(lambda a: a + 1.5, variables["batch_stats"])
    strategy = make("sharded_8")
    trainer = jd.training.Trainer(strategy, BatchNormMLP(), optimizer(), ce,
                                  train_kwargs={"train": True})
    # no model_state: init's (mean 0, var 1)
    loaded = trainer.load_state(params=variables["params"], batch=data[0])
    assert_variable_layout(strategy, loaded, "the loaded state")
    assert_close(loaded.model_state, {"batch_stats": variables["batch_stats"]})
    # no opt_state: a fresh one, laid out as init lays it out
    assert_close(loaded.opt_state, opt_state)
    loaded = trainer.load_state(params=variables["params"], model_state={"batch_stats": stats})
    assert_close(loaded.model_state, {"batch_stats": stats})
    assert_variable_layout(strategy, loaded, "the reloaded state")


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_two_processes_load_a_plain_run_and_continue_it(plain_run, tmp_path):
    """Slow because of its 2-process job (imports, gloo, compiles of the FSDP and the mirrored
    trainer)."""
    _, losses, final = plain_run
    out = tmp_path / "result.npz"
    proc = subprocess.run(
        [*LAUNCH, "-n", "2", "--cpu-devices", "4", "--timeout", "340",
         str(Path(__file__).parent / "multiprocess" / "load_worker.py"), str(out)],
        env=launch_env(), capture_output=True, text=True, timeout=380,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "[0] process 0 done" in proc.stdout and "[1] process 1 done" in proc.stdout
    with np.load(out) as result:
        np.testing.assert_allclose(result["losses"], losses, rtol=1e-5)
        for path, want in jax.tree_util.tree_leaves_with_path(jax.device_get(final)):
            for trainer in ("fsdp", "mirrored"):
                np.testing.assert_allclose(result[f"{trainer}/{jax.tree_util.keystr(path)}"], want,
                                           rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_an_nnx_trainer_needs_no_batch_and_keeps_its_module_state():
    fresh = NnxNet(nnx.Rngs(0))
    params = jax.device_get(nnx.to_pure_dict(nnx.state(fresh, nnx.Param)))
    params = jax.tree.map(lambda a: a + 1.0, params)
    model = NnxNet(nnx.Rngs(1))
    trainer = jd.training.Trainer(make("mirrored_8"), model, optimizer(), ce)
    loaded = trainer.load_state(params=params)  # no batch: an nnx module knows its shapes
    assert_close(loaded.params, params)
    assert_close(nnx.state(model, nnx.Param), params)  # written into the trainer's module
    # the module's own
    assert_close(loaded.model_state, nnx.to_pure_dict(nnx.state(fresh, nnx.Not(nnx.Param))))


@pytest.mark.timeout(300)
def test_the_optimizer_state_of_a_run_without_the_trainers_clipping_fits():
    data = batches()
    variables, opt_state = plain_state()
    opt_state = jax.tree.map(lambda a: a + 3 if a.dtype == np.int32 else a, opt_state)
    trainer = jd.training.Trainer(make("one_device"), MLP(), optimizer(), ce, clip_grad_norm=1.0)
    loaded = trainer.load_state(params=variables["params"], opt_state=opt_state, step=3,
                                batch=data[0])
    assert int(loaded.opt_state[1][0].count) == 3  # (the clip's EmptyState, adam's state)
    with pytest.raises(ValueError,
                       match=r"opt_state\[0\]\.mu\['Dense_0'\]\['bias'\] \(\(4,\) float32\) is "
                             r"missing"):
        trainer.load_state(params=variables["params"],
                           opt_state=optax.sgd(0.1).init(variables["params"]))
