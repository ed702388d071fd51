"""jaxdist: tf.distribute strategies rebuilt on JAX, for Flax and Optax.

Two ways in. ``strategy.jit(step, batch_argnums=...)`` compiles your own single-device step for a
strategy: the arguments named by ``batch_argnums`` are split over the replicas, the rest are laid
out by the strategy, and the step computes the numbers it computes on one device.
``jd.training.Trainer(strategy, model, optimizer, loss_fn).fit(data, steps=...)`` is the loop built
on it (checkpoints, preemption, logs); `jd.training.prepare` wraps your own loop's step and data in
two lines.

Importing jaxdist imports nothing else: each name here is imported from its package on first use
(the names are listed in ``__init__.pyi``, which type checkers read), so ``python -m
jaxdist.launch`` starts without loading JAX. No JAX backend starts either: devices are looked up
when a strategy is created.

Each public name lives in one package (``jd.strategies``, ``jd.replicate``, ``jd.costs``,
``jd.training``, ...); the ones used most are also here (``jd.MirroredStrategy`` is
``jd.strategies.MirroredStrategy``). The job's own two, ``jd.initialize_cluster`` and
``jd.configure_compilation_cache``, are only here.

Examples:
    >>> import jax, numpy as np, jaxdist as jd
    >>> def sgd_step(w, x):
    ...     loss, g = jax.value_and_grad(lambda w: ((x @ w) ** 2).mean())(w)
    ...     return w - 0.1 * g, loss
    >>> strategy = jd.MirroredStrategy()
    >>> step = strategy.jit(sgd_step, donate_argnums=0, batch_argnums=1)  # x's rows split
    >>> w, loss = step(strategy.mirror(np.ones(3, np.float32)), np.ones((64, 3), np.float32))
    >>> round(float(loss), 3)
    9.0

    The Trainer, on the same strategy:

    >>> import flax.linen as nn, optax
    >>> trainer = jd.training.Trainer(strategy, nn.Dense(1), optax.sgd(0.1),
    ...                               lambda out, y: ((out - y) ** 2).mean())
    >>> history = trainer.fit([(np.ones((16, 3), np.float32), np.ones((16, 1), np.float32))],
    ...                       steps=2, verbose=0)
    >>> trainer.step
    2
    >>> with strategy.scope():
    ...     assert jd.get_strategy() is strategy
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)

__version__ = "0.1.0"
