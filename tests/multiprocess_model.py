"""The model and data shared by the multi-process tests and their single-device reference."""

import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from registry import adam


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(32)(x)))


MODEL = MLP()
OPT = adam(1e-2)


def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(MODEL.apply(params, x), y).mean()


def make_train_step(loss):
    """The unmodified single-device step of ``loss(params, x, y)``: ``(state, (x, y)) -> (state,
    loss)``."""

    def train_step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, opt_state = OPT.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    return train_step


train_step = make_train_step(loss_fn)


# Jitted: one program, where flax's eager init dispatches (and on CPU compiles) every operation on
# its own: ~3 s for the MLP and ~10 s for the LM per process, for the same values bit for bit.
@jax.jit
def init_state(key):
    params = MODEL.init(key, jnp.zeros((1, 8), jnp.float32))
    return params, OPT.init(params)


def batches(steps=20, batch=32):
    rng = np.random.default_rng(7)
    out = []
    for _ in range(steps):
        x = rng.normal(size=(batch, 8)).astype(np.float32)
        out.append((x, (x[:, :4].argmax(1)).astype(np.int32)))
    return out


# ------------------------------------------------------------------ a tiny LM (the char LM example)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from char_lm import CharLM, LMConfig  # noqa: E402

LM = CharLM(LMConfig(vocab_size=16, d_model=16, num_heads=2, num_layers=1, mlp_dim=32, max_len=8))


def lm_loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(LM.apply(params, x), y).mean()


lm_train_step = make_train_step(lm_loss)


@jax.jit  # see init_state
def lm_init_state(key):
    # boxed: every parameter names its logical axes
    params = LM.init(key, jnp.zeros((1, 8), jnp.int32))
    return params, OPT.init(params)


def lm_batches(steps=8, batch=16):
    rng = np.random.default_rng(11)
    windows = rng.integers(0, 16, size=(steps, batch, 9)).astype(np.int32)
    return [(w[:, :-1], w[:, 1:]) for w in windows]
