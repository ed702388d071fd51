"""Code we did not write, through jaxdist: the Flax linen MNIST example and the Flax NNX MNIST
tutorial.

The step functions below are written the way those two official Flax programs write theirs (same
signatures, same Flax / optax calls; nnx steps update the model, optimizer, metrics and rngs in
place and return nothing), with nothing distributed in them. Data: scikit-learn's 8x8 digits
(bundled, no download) as small MNIST.

Each program runs twice: as its authors run it (`jax.jit` / `nnx.jit`, one device) and through
`strategy.jit` with its batch arguments declared. Losses, accuracies, parameters, optimizer state
and metrics must agree to fp32 precision (rtol 1e-5), in training and in evaluation on the host test
set, for every placement of that test set a user can hand in. Evaluation is where XLA's Shardy
partitioner (upstream) miscomputes a conv net whose kernel is split on its output channels while the
batch is replicated; jaxdist must not walk users into it.
"""

from __future__ import annotations

import contextlib
import functools
import types
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec
from registry import assert_variable_layout, make
from sklearn.datasets import load_digits

import jaxdist as jd

RTOL, ATOL = 1e-5, 1e-6
BATCH = 64  # the example's batch size is 128 on 60k images; 64 on 1.8k digits
TRAIN_ROWS = 512  # 8 steps
TEST_ROWS = 256  # rows 1536:1792 of the digits, disjoint from the training rows


@functools.cache
def digits():
    data = load_digits()
    images = (data.images[..., None] / 16.0).astype(np.float32)  # (1797, 8, 8, 1) in [0, 1]
    return images, data.target  # labels int64, as both Flax programs' loaders give them


def _assert_close(got, want, what):
    for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(w), rtol=RTOL, atol=ATOL,
            err_msg=f"{what}: leaf {i} differs from one device"
        )


# ==================================================================================================
# (a) The linen MNIST example: CNN, create_train_state, apply_model (has_aux), update_model,
# train_epoch.
# ==================================================================================================
class CNN(nn.Module):
    """The example's CNN (for 8x8 inputs its flattened features are 2*2*64 = 256)."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(features=32, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=64, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.Dense(features=256)(x)
        x = nn.relu(x)
        x = nn.Dense(features=10)(x)
        return x


def apply_model(state, images, labels):
    """Gradients, loss and accuracy for one batch (the example jits this with ``@jax.jit``)."""

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, images)
        one_hot = jax.nn.one_hot(labels, 10)
        loss = jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot))
        return loss, logits

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(state.params)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return grads, loss, accuracy


def update_model(state, grads):
    return state.apply_gradients(grads=grads)


def create_train_state(rng, config):
    cnn = CNN()
    params = cnn.init(rng, jnp.ones([1, 8, 8, 1]))["params"]
    tx = optax.sgd(config.learning_rate, config.momentum)
    return train_state.TrainState.create(apply_fn=cnn.apply, params=params, tx=tx)


def train_epoch(state, train_ds, batch_size, rng, apply_model, update_model):
    """The example's epoch loop; the compiled steps are passed in instead of being module
    globals."""
    steps_per_epoch = len(train_ds["image"]) // batch_size
    perms = jax.random.permutation(rng, len(train_ds["image"]))
    perms = perms[: steps_per_epoch * batch_size].reshape((steps_per_epoch, batch_size))
    losses, accuracies = [], []
    for perm in perms:
        grads, loss, accuracy = apply_model(state, train_ds["image"][perm, ...],
                                            train_ds["label"][perm, ...])
        state = update_model(state, grads)
        losses.append(loss)
        accuracies.append(accuracy)
    return state, np.array(losses), np.array(accuracies)


# The example's default hyperparameters, in an attribute-access config object (the example's
# ConfigDict; not a pytree, not an array).
CONFIG = types.SimpleNamespace(learning_rate=0.1, momentum=0.9)


def linen_datasets():
    """As the example's get_datasets: dicts of whole splits, as jax arrays on the default device."""
    images, labels = digits()
    train_ds = {"image": jnp.asarray(images[:TRAIN_ROWS]),
                "label": jnp.asarray(labels[:TRAIN_ROWS])}
    test_ds = {
        "image": jnp.asarray(images[1536 : 1536 + TEST_ROWS]),
        "label": jnp.asarray(labels[1536 : 1536 + TEST_ROWS]),
    }
    return train_ds, test_ds


def linen_train_and_evaluate(apply_model, update_model, create_state):
    train_ds, test_ds = linen_datasets()
    rng, init_rng = jax.random.split(jax.random.key(0))
    state = create_state(init_rng)
    _, input_rng = jax.random.split(rng)
    state, losses, accuracies = train_epoch(state, train_ds, BATCH, input_rng, apply_model,
                                            update_model)
    test_grads, test_loss, test_accuracy = apply_model(state, test_ds["image"], test_ds["label"])
    return {
        "state": state,
        "losses": losses,
        "accuracies": accuracies,
        "test_grads": test_grads,
        "test_loss": float(test_loss),
        "test_accuracy": float(test_accuracy),
    }


@pytest.fixture(scope="session")
def linen_reference():
    """The example as written: ``@jax.jit`` steps, one device."""
    return linen_train_and_evaluate(
        jax.jit(apply_model), jax.jit(update_model), lambda rng: create_train_state(rng, CONFIG)
    )


# The (replica, model) mesh: this CNN's evaluation below, and a CNN trained on it in
# test_equivalence's conv_batchnorm test. The TPU strategy in the full suite
# (registry.QUICK_TIER_LEAVES_OUT).
TPU_8 = pytest.param("tpu_8", marks=pytest.mark.slow)


@pytest.mark.parametrize("strategy_name", ["mirrored_8", "sharded_8", TPU_8])
def test_linen_mnist_example_trains_and_evaluates_like_one_device(strategy_name, linen_reference):
    """The example's loop, steps compiled by strategy.jit with the images/labels declared batches:
    every step's loss and accuracy, the trained parameters and momentum, and the loss, accuracy and
    gradients on the host test set equal the @jax.jit run; the state lives in the strategy's
    variable layout."""
    strategy = make(strategy_name)
    with strategy.scope():
        got = linen_train_and_evaluate(
            strategy.jit(apply_model, batch_argnums=(1, 2)),
            strategy.jit(update_model, batch_argnums=()),  # declared: no batch argument
            lambda rng: create_train_state(rng, CONFIG),  # the example's own initializer, unplaced
        )
    want = linen_reference
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=RTOL)
    np.testing.assert_allclose(got["accuracies"], want["accuracies"], rtol=RTOL)
    _assert_close(got["state"].params, want["state"].params, "trained params")
    _assert_close(got["state"].opt_state, want["state"].opt_state, "momentum")
    assert int(got["state"].step) == int(want["state"].step) == TRAIN_ROWS // BATCH
    np.testing.assert_allclose(got["test_loss"], want["test_loss"], rtol=RTOL)
    np.testing.assert_allclose(got["test_accuracy"], want["test_accuracy"], rtol=RTOL)
    _assert_close(got["test_grads"], want["test_grads"], "test-set gradients")
    assert_variable_layout(strategy, (got["state"].params, got["state"].opt_state), "trained state")


def test_linen_create_variables_takes_the_examples_config_argument():
    """``strategy.create_variables(create_train_state, rng, config)``: the example's initializer
    with its non-array config argument creates the state straight in the strategy's layout, equal to
    one device."""
    strategy = make("sharded_8")
    _, init_rng = jax.random.split(jax.random.key(0))
    with strategy.scope():
        state = strategy.create_variables(create_train_state, init_rng, CONFIG)
    want = create_train_state(init_rng, CONFIG)
    _assert_close(state.params, want.params, "initial params")
    assert_variable_layout(strategy, (state.params, state.opt_state), "created state")


PLACEMENTS = ["host_declared", "distributed", "replicated_on_mesh_declared", "host_undeclared"]

# Besides the registry: ShardedStrategy with its default min_shard_size, which on this CNN splits
# only the big kernels (Conv_1's on its output channels, the Dense kernels on their rows): the
# layout of the upstream miscompute, as users of the example met it.
SHARDED_DEFAULT = "sharded_8_default_min_shard_size"


def make_client_strategy(name):
    if name == SHARDED_DEFAULT:
        make("sharded_8")  # skips when devices are short
        return jd.ShardedStrategy(jax.devices()[:8])
    return make(name)


def evaluate_on(strategy, fn, placement, state, images, labels):
    """``fn(state, images, labels)`` through strategy.jit, the test set handed in as ``placement``
    says."""
    declared = strategy.jit(fn, batch_argnums=(1, 2))
    if placement == "host_declared":
        return declared(state, images, labels)
    if placement == "distributed":
        (x, y) = next(iter(strategy.experimental_distribute_dataset([(images, labels)])))
        return declared(state, x, y)
    if placement == "replicated_on_mesh_declared":
        everywhere = NamedSharding(strategy.mesh, PartitionSpec())
        return declared(
            state, jax.device_put(images, everywhere), jax.device_put(labels, everywhere)
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = strategy.jit(fn)(state, images, labels)
    if strategy.num_replicas_in_sync > 1:  # host_undeclared: mirrored, and said so
        # (the registry's (replica, model) mesh also reports its idle model axis: not what this test
        # is about)
        caught = [w for w in caught if w.category is not jd.IdleAxisWarning]
        assert [w.category for w in caught] == [jd.UndeclaredBatchWarning], [
            str(w.message) for w in caught
        ]
        assert "batch_argnums" in str(caught[0].message)
    return out


def host_test_set_and_state(linen_reference):
    _, test_ds = linen_datasets()
    # host copy: placed in the variable layout
    state = jax.tree.map(np.asarray, linen_reference["state"])
    return state, np.asarray(test_ds["image"]), np.asarray(test_ds["label"])


# One device and two replicas add nothing here that mirrored_8 does not cover; the TPU strategy's
# jit is the same as mirrored_8's. The (replica, model) mesh runs in the full suite
# (registry.QUICK_TIER_LEAVES_OUT).
SHARDED_4X2 = pytest.param("sharded_4x2", marks=pytest.mark.slow)


@pytest.mark.parametrize("strategy_name", ["mirrored_8", "sharded_8", SHARDED_4X2, SHARDED_DEFAULT])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_linen_mnist_evaluation_equals_one_device_for_every_test_set_placement(
    strategy_name, placement, linen_reference
):
    """The example's evaluation, ``apply_model(state, test_images, test_labels)`` on the trained
    state, through strategy.jit, for each way a user can hand in the test set: host arrays declared
    as batches (split over the replicas), a distributed batch, arrays the user already replicated on
    the strategy's mesh, and host arrays NOT declared (mirrored; jaxdist warns once, naming
    ``batch_argnums``). The last two replicate the batch while ShardedStrategy splits conv kernels:
    the Shardy miscompute must not reach the user."""
    strategy = make_client_strategy(strategy_name)
    state, images, labels = host_test_set_and_state(linen_reference)
    grads, loss, accuracy = evaluate_on(strategy, apply_model, placement, state, images, labels)
    np.testing.assert_allclose(float(loss), linen_reference["test_loss"], rtol=RTOL)
    np.testing.assert_allclose(float(accuracy), linen_reference["test_accuracy"], rtol=RTOL)
    _assert_close(grads, linen_reference["test_grads"], f"test-set gradients ({placement})")


def loss_and_gradient_norm(state, images, labels):
    """The example's apply_model, reporting the gradient's global norm (what a training log shows)
    instead of returning the gradients."""
    grads, loss, _ = apply_model(state, images, labels)
    return loss, optax.tree.norm(grads)


@pytest.mark.parametrize("strategy_name", ["sharded_8", SHARDED_4X2, SHARDED_DEFAULT])
@pytest.mark.parametrize("placement", ["host_declared", "replicated_on_mesh_declared",
                                       "host_undeclared"])
def test_linen_gradient_norm_on_the_test_set_equals_one_device_for_every_placement(
    strategy_name, placement, linen_reference
):
    """As above, on ShardedStrategy, for a step whose gradients never leave it: no output layout
    pins them to the kernels' layout, so only jaxdist's workaround stands between a replicated batch
    and the miscompute."""
    strategy = make_client_strategy(strategy_name)
    state, images, labels = host_test_set_and_state(linen_reference)
    want_loss, want_norm = jax.jit(loss_and_gradient_norm)(state, images, labels)
    loss, norm = evaluate_on(strategy, loss_and_gradient_norm, placement, state, images, labels)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=RTOL,
                               err_msg=f"loss ({placement})")
    np.testing.assert_allclose(float(norm), float(want_norm), rtol=RTOL,
                               err_msg=f"gradient norm ({placement})")


# ==================================================================================================
# (b) The NNX MNIST tutorial: CNN(nnx.Module) with call-time rngs, nnx.Optimizer, nnx.MultiMetric,
#     train_step / eval_step / pred_step that update their arguments in place.
# ==================================================================================================
class NnxCNN(nnx.Module):
    """The tutorial's CNN: conv / batch norm / dropout / pooling; 8x8 inputs flatten to 2*2*64 =
    256."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(256, 256, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        x = self.linear2(x)
        return x


def nnx_loss_fn(model: NnxCNN, batch, rngs: nnx.Rngs | None = None):
    logits = model(batch["image"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits,
                                                           labels=batch["label"]).mean()
    return loss, logits


def train_step(model: NnxCNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, rngs: nnx.Rngs,
               batch):
    """One step, all updates in place, nothing returned (the tutorial decorates it with
    ``@nnx.jit``)."""
    grad_fn = nnx.value_and_grad(nnx_loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch, rngs)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


def eval_step(model: NnxCNN, metrics: nnx.MultiMetric, batch):
    loss, logits = nnx_loss_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])


def pred_step(model: NnxCNN, batch):
    logits = model(batch["image"], None)
    return logits.argmax(axis=1)


NNX_BATCH = 32  # the tutorial's
# The tutorial trains with optax.adamw(0.005, 0.9). Adam divides each update by the gradient's RMS,
# and conv2's bias has a gradient that is zero up to rounding (batch_norm2 subtracts the batch mean
# right after it): Adam turns that rounding noise into full-size steps, so two correct programs (one
# device, eight) part ways on it and, through batch_norm2's running mean, on the evaluation. SGD
# with momentum (the linen example's optimizer) leaves the noise at noise level; the nnx.Optimizer
# machinery exercised is the same.
OPTIMIZER = optax.sgd(0.05, 0.9)
NNX_TRAIN_STEPS = 8
NNX_TEST_ROWS = 128


def make_batches(images, labels, batch_size):
    """The tutorial's loader: dicts of numpy arrays, incomplete last batch dropped."""
    for i in range(0, len(labels), batch_size):
        if len(labels[i : i + batch_size]) < batch_size:
            break
        yield {"image": images[i : i + batch_size], "label": np.array(labels[i : i + batch_size])}


def nnx_tutorial(jit, scope):
    """The tutorial's program: build under ``scope``, train, evaluate, predict; ``jit(fn,
    batch_argnum)`` compiles each step."""
    images, labels = digits()
    with scope:
        model = NnxCNN(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, OPTIMIZER, wrt=nnx.Param)
        metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    train_model = nnx.view(model, deterministic=False, use_running_average=False)
    eval_model = nnx.view(model, deterministic=True, use_running_average=True)
    train, evaluate, predict = jit(train_step, 4), jit(eval_step, 2), jit(pred_step, 1)
    rngs = nnx.Rngs(0)
    n = NNX_BATCH * NNX_TRAIN_STEPS
    for batch in make_batches(images[:n], labels[:n], NNX_BATCH):
        train(train_model, optimizer, metrics, rngs, batch)
    train_metrics = {k: float(v) for k, v in metrics.compute().items()}
    metrics.reset()
    test_images, test_labels = (images[1536 : 1536 + NNX_TEST_ROWS],
                                labels[1536 : 1536 + NNX_TEST_ROWS])
    for test_batch in make_batches(test_images, test_labels, NNX_BATCH):
        evaluate(eval_model, metrics, test_batch)
    test_metrics = {k: float(v) for k, v in metrics.compute().items()}
    predictions = np.asarray(predict(eval_model, test_batch))
    return {
        "model": model,
        "optimizer": optimizer,
        "metrics": metrics,
        "rngs": rngs,
        "train_metrics": train_metrics,
        "test_metrics": test_metrics,
        "predictions": predictions,
    }


@pytest.fixture(scope="session")
def nnx_reference():
    """The tutorial as written: ``@nnx.jit`` steps, one device."""
    return nnx_tutorial(lambda fn, _: nnx.jit(fn), contextlib.nullcontext())


# Mirrored and Sharded (one device, two replicas and the TPU strategy's jit add nothing the linen
# tests and test_equivalence's nnx step do not already cover, and each run of the tutorial costs ~10
# s on 2 cores); the (replica, model) mesh in the full suite only.
NNX_STRATEGIES = pytest.mark.parametrize("strategy_name", ["mirrored_8", "sharded_8", SHARDED_4X2])
_nnx_runs: dict[str, dict] = {}


def nnx_run(strategy_name):
    """The tutorial through ``strategy.jit(step, batch_argnums=...)``, model built in
    ``strategy.scope()`` (once per strategy; the tests below read different parts of the result)."""
    if strategy_name not in _nnx_runs:
        strategy = make(strategy_name)
        _nnx_runs[strategy_name] = {
            "strategy": strategy,
            **nnx_tutorial(lambda fn, argnum: strategy.jit(fn, batch_argnums=(argnum,)),
                           strategy.scope()),
        }
    return _nnx_runs[strategy_name]


@NNX_STRATEGIES
def test_nnx_tutorial_train_step_updates_model_and_optimizer_in_place_like_nnx_jit(
    strategy_name, nnx_reference
):
    """After the training steps, the user's own model (through the nnx.view it trained) holds the
    same parameters and batch statistics as under nnx.jit, the optimizer the same step count and
    Adam moments, and the rngs the same stream position (dropout keys advanced in place, not
    reused)."""
    got, want = nnx_run(strategy_name), nnx_reference
    _assert_close(nnx.state(got["model"], nnx.Param), nnx.state(want["model"], nnx.Param), "params")
    _assert_close(nnx.state(got["model"], nnx.BatchStat), nnx.state(want["model"], nnx.BatchStat),
                  "batch stats")
    _assert_close(nnx.state(got["optimizer"]), nnx.state(want["optimizer"]), "optimizer state")
    assert int(got["optimizer"].step[...]) == NNX_TRAIN_STEPS
    assert int(got["rngs"].default.count[...]) == int(want["rngs"].default.count[...])


@NNX_STRATEGIES
def test_nnx_tutorial_metrics_update_in_place_like_nnx_jit(strategy_name, nnx_reference):
    """The MultiMetric the steps updated in place computes the same training and test loss and
    accuracy."""
    got, want = nnx_run(strategy_name), nnx_reference
    for split in ("train_metrics", "test_metrics"):
        assert set(got[split]) == {"accuracy", "loss"}
        for name, value in want[split].items():
            assert np.isfinite(got[split][name]), f"{split}[{name!r}] = {got[split][name]}"
            np.testing.assert_allclose(got[split][name], value, rtol=RTOL,
                                       err_msg=f"{split}[{name!r}]")


@NNX_STRATEGIES
def test_nnx_tutorial_eval_and_pred_steps_equal_nnx_jit(strategy_name, nnx_reference):
    """eval_step on the eval view (running averages, no dropout) and pred_step's predictions."""
    got, want = nnx_run(strategy_name), nnx_reference
    np.testing.assert_allclose(got["test_metrics"]["loss"], want["test_metrics"]["loss"], rtol=RTOL)
    np.testing.assert_array_equal(got["predictions"], want["predictions"])


@NNX_STRATEGIES
def test_nnx_tutorial_state_lives_in_the_strategys_layout_after_steps(strategy_name):
    """The arrays the steps wrote back into the model and the optimizer are the strategy's
    (replicated on Mirrored, split over the replicas on Sharded), not host or single-device
    copies."""
    got = nnx_run(strategy_name)
    strategy = got["strategy"]
    assert_variable_layout(strategy, nnx.state(got["model"], nnx.Param), "model params")
    assert_variable_layout(strategy, nnx.state(got["model"], nnx.BatchStat), "batch stats")
    assert_variable_layout(strategy, nnx.state(got["optimizer"], nnx.OptState), "optimizer moments")
    if isinstance(strategy, jd.ShardedStrategy) and strategy.num_replicas_in_sync > 1:
        kernel = got["model"].linear1.kernel[...]
        assert not kernel.sharding.is_fully_replicated, (
            f"linear1 kernel not split: {kernel.sharding}"
        )
