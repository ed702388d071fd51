"""The transformer LM problem: the char-level decoder of ``examples/char_lm.py`` under FSDP and FSDP
x TP.

The model, its logical-axis annotations and its rule table are imported from the example (loaded by
path: ``examples/`` is not a package). Every stepper trains the same `LMProblem`: the same initial
variables (drawn once on the host, then placed in each stepper's layout), the same AdamW and the
same fixed batches of the example's text, so two sides of a row differ only in how the step is
compiled and placed.

The suite hands every stepper ``make_problem(spec)`` of the MLP models; an `LMSpec` is a `ModelSpec`
with no hidden layers (that MLP problem is tiny and never compiled), and the LM steppers read only
its ``spec``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import pathlib
import sys
from types import ModuleType
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax

import jaxdist as jd
from benchmarks.models import ModelSpec
from benchmarks.runners import Unavailable, _cycle, _Loop

__all__ = [
    "LM_MODELS",
    "LM_QUICK",
    "LM_TINY",
    "LMHandJit",
    "LMProblem",
    "LMSpec",
    "LMStrategyJit",
    "char_lm",
    "lm_problem",
    "add_process_entries",
    "memory_table",
    "mesh_strategy",
    "tp_strategy",
]

_EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "char_lm.py"


@functools.cache
def char_lm() -> ModuleType:
    """``examples/char_lm.py`` as a module (loaded once; registered as ``char_lm`` for its
    dataclasses)."""
    if "char_lm" in sys.modules:
        return sys.modules["char_lm"]
    spec = importlib.util.spec_from_file_location("char_lm", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["char_lm"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@dataclasses.dataclass(frozen=True)
class LMSpec(ModelSpec):
    """One LM benchmark configuration (``hidden`` stays empty: see the module docstring).

    Attributes:
        num_layers: transformer blocks.
        d_model: residual width (the MLP is ``4 * d_model`` wide).
        num_heads: attention heads (a multiple of the model-axis size, 2).
        seq_len: characters per example.
    """

    num_layers: int = 2
    d_model: int = 128
    num_heads: int = 4
    seq_len: int = 128

    @property
    def layers(self) -> str:
        """E.g. ``LM 2x128 seq128`` (the table's model column)."""
        return f"LM {self.num_layers}x{self.d_model} seq{self.seq_len}"


LM_QUICK = LMSpec("lm", (), 16, num_layers=2, d_model=128, num_heads=4, seq_len=128)
# --smoke only
LM_TINY = LMSpec("lm-tiny", (), 8, batches=2, num_layers=1, d_model=16, num_heads=2, seq_len=8)
LM_MODELS = {spec.name: spec for spec in (LM_QUICK, LM_TINY)}


@dataclasses.dataclass(frozen=True)
class LMProblem:
    """What an LM stepper trains.

    Attributes:
        spec: the configuration.
        model: the example's ``CharLM``.
        optimizer: AdamW.
        host_state: ``(variables, opt_state)`` as host numpy (Flax annotation boxes kept), the same
            start for every stepper.
        host_batches: fixed ``(tokens, next_tokens)`` int32 batches of the example's text.
    """

    spec: LMSpec
    model: Any
    optimizer: optax.GradientTransformation
    host_state: Any
    host_batches: tuple[tuple[np.ndarray, np.ndarray], ...]

    def step(self, state: Any, batch: Any) -> Any:
        """The unmodified single-device step: ``(state, (x, y)) -> (state, loss)``."""
        variables, opt_state = state
        x, y = batch
        loss_fn = char_lm().loss_fn

        def loss(v):
            return loss_fn(self.model.apply(v, x), y)

        value, grads = jax.value_and_grad(loss)(variables)
        updates, opt_state = self.optimizer.update(grads, opt_state, variables)
        return (optax.apply_updates(variables, updates), opt_state), value


@functools.cache
def lm_problem(spec: LMSpec, remat: bool = False, seed: int = 0) -> LMProblem:
    """Build (once per spec) the model, AdamW, initial state and fixed batches of ``spec``.

    The initial variables are drawn on the host (normal, std 0.02; norm scales 1) rather than by
    compiling ``model.init``: XLA's CPU compile of the initializer's RNG would dominate a smoke run.
    """
    lm = char_lm()
    text = lm.load_text()
    vocab = lm.CharVocab.from_text(text)
    tokens, _ = lm.split(vocab.encode(text))
    cfg = lm.LMConfig(
        vocab_size=vocab.size,
        d_model=spec.d_model,
        num_heads=spec.num_heads,
        num_layers=spec.num_layers,
        mlp_dim=4 * spec.d_model,
        max_len=spec.seq_len,
        remat=remat,
    )
    model = lm.CharLM(cfg)
    optimizer = optax.adamw(1e-3, weight_decay=0.01)
    shapes = jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, spec.seq_len), np.int32))
    rng = np.random.default_rng(seed)

    def draw(path: Any, s: jax.ShapeDtypeStruct) -> np.ndarray:
        if jax.tree_util.keystr(path).endswith("['scale']"):
            return np.ones(s.shape, s.dtype)
        return (rng.normal(size=s.shape) * 0.02).astype(s.dtype)

    variables = jax.tree_util.tree_map_with_path(draw, shapes)
    opt_shapes = jax.eval_shape(optimizer.init, variables)
    opt_state = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), opt_shapes)
    batches = lm.train_batches(tokens, spec.batch, spec.seq_len, spec.batches, epoch=0, seed=seed)
    return LMProblem(spec, model, optimizer, (variables, opt_state), tuple(batches))


@functools.cache
def tp_strategy(devices: tuple[jax.Device, ...]) -> jd.ShardedStrategy:
    """FSDP x tensor parallelism over ``devices``: mesh ``(replica, model) = (N / 2, 2)``, the
    example's rules.

    Raises:
        Unavailable: when the device count is odd (the model axis needs 2).
    """
    if len(devices) % 2:
        raise Unavailable("FSDP x TP needs an even device count for model_parallelism=2, got "
                          f"{len(devices)}")
    lm = char_lm()
    return jd.ShardedStrategy(
        devices,
        model_parallelism=2,
        logical_axis_rules=lm.LOGICAL_AXIS_RULES,
        activation_axes=lm.ACTIVATION_AXES,
    )


@functools.cache
def mesh_strategy(devices: tuple[jax.Device, ...]) -> jd.ShardedStrategy:
    """The LM on a user's own mesh, MaxText-style: ``(data, fsdp, tensor) = (N / 4, 2, 2)``, the
    batch over ``data`` x ``fsdp``, FSDP over ``fsdp`` only (HSDP), tensor parallelism over
    ``tensor``, and the example's rule table naming those axes.

    Raises:
        Unavailable: when 4 does not divide the device count.
    """
    if len(devices) % 4:
        raise Unavailable("the (data, fsdp, tensor) mesh needs a multiple of 4 devices, got "
                          f"{len(devices)}")
    lm = char_lm()
    mesh = jax.sharding.Mesh(np.array(devices).reshape(-1, 2, 2), ("data", "fsdp", "tensor"))
    return jd.ShardedStrategy(
        mesh=mesh,
        batch_axes=("data", "fsdp"),
        fsdp_axes=("fsdp",),
        logical_axis_rules=lm.logical_axis_rules(("data", "fsdp"), "tensor"),
        activation_axes=lm.ACTIVATION_AXES,
    )


def _place(strategy: jd.Strategy, problem: LMProblem) -> Any:
    """The problem's initial state in ``strategy``'s variable layout."""
    return jax.device_put(problem.host_state, strategy.variable_shardings(problem.host_state))


def _rules_scope(strategy: jd.Strategy) -> contextlib.AbstractContextManager[Any]:
    """What a hand-written step traces under for the model's activation constraints to mean the same
    thing as in ``strategy.jit``: the mesh (abstract) and Flax's logical axis rules; nothing without
    rules."""
    rules = getattr(strategy, "logical_axis_rules", ())
    if not rules:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(jax.sharding.use_abstract_mesh(strategy.mesh.abstract_mesh))
    stack.enter_context(nn.logical_axis_rules(rules))
    return stack


class LMStrategyJit(_Loop):
    """``strategy.jit(problem.step, donate_argnums=0)``.

    Args:
        strategy: the jaxdist strategy.
        problem: the LM to train.
        feed: ``"device"`` cycles batches placed once with ``experimental_distribute_values``;
            ``"host"`` passes the host numpy batches, declared with ``batch_argnums=(1,)`` (placed
            every step, as ``model.fit`` does).
    """

    def __init__(self, strategy: jd.Strategy, problem: LMProblem, feed: str = "device"):
        state = _place(strategy, problem)
        if feed == "device":
            batches = _cycle(strategy.experimental_distribute_values(b)
                             for b in problem.host_batches)
        elif feed == "host":
            batches = _cycle(problem.host_batches)
        else:
            raise ValueError(f"feed={feed!r} must be 'device' or 'host'.")
        self.jitted = strategy.jit(problem.step, donate_argnums=0, batch_argnums=(1,))
        super().__init__(self.jitted, state, batches)


class LMHandJit(_Loop):
    """Hand-written ``jax.jit`` with in/out shardings copied from the state ``strategy`` places,
    batches split over the strategy's batch axes, donated state; traced under the strategy's rules
    (see `_rules_scope`)."""

    def __init__(self, strategy: jd.Strategy, problem: LMProblem):
        state = _place(strategy, problem)
        layouts = jax.tree.map(lambda a: a.sharding, state)
        split = strategy.batch_sharding

        def step(state: Any, batch: Any) -> Any:
            with _rules_scope(strategy):
                return problem.step(state, batch)

        self.jitted = jax.jit(
            step,
            in_shardings=(layouts, split),
            out_shardings=(layouts, strategy.replicated_sharding),
            donate_argnums=0,
        )
        batches = _cycle(jax.device_put(b, split) for b in problem.host_batches)
        super().__init__(self.jitted, state, batches)

    def compiled(self) -> Any:
        """The compiled step for the current state (for ``memory_analysis``)."""
        return self.jitted.lower(self._state, next(self._batches)).compile()


# ------------------------------------------------------------------------------------------- memory
def _memory(strategy: jd.Strategy, problem: LMProblem, measure_temp: bool) -> dict[str, Any]:
    stepper = LMHandJit(strategy, problem)
    try:
        params, opt_state = stepper._state
        temp = getattr(stepper.compiled().memory_analysis(), "temp_size_in_bytes",
                       None) if measure_temp else None
        return {
            "param_bytes": jd.costs.bytes_per_device(params),
            "optimizer_bytes": jd.costs.bytes_per_device(opt_state),
            "state_bytes": jd.costs.bytes_per_device((params, opt_state)),
            "temp_bytes": None if temp is None else int(temp),
        }
    finally:
        stepper.close()


def memory_table(
    spec: LMSpec,
    devices: tuple[jax.Device, ...],
    mirrored: jd.Strategy,
    fsdp: jd.Strategy,
    measure_temp: bool = True,
) -> dict:
    """Per-device bytes of params + optimizer state and XLA temp bytes of the compiled step, per
    layout.

    Entries: Mirrored, FSDP, FSDP x TP, and FSDP x TP with ``remat`` (the step compiled as a
    hand-written ``jax.jit`` with the strategy's layouts: the same program ``strategy.jit`` builds).
    ``tp_state_pass`` checks FSDP x TP state per device <= (1/N + 5%) of Mirrored's. With
    ``measure_temp=False`` (smoke runs) the temp bytes are not measured (None) and the remat entry,
    whose state equals FSDP x TP's, is left out.
    """
    entries: dict[str, dict[str, Any]] = {}
    plain, remat = lm_problem(spec), lm_problem(spec, remat=measure_temp)
    strategies = [("Mirrored", mirrored, plain), ("FSDP", fsdp, plain)]
    try:
        tp = tp_strategy(devices)
        strategies += [("FSDP x TP", tp, plain)] + ([("FSDP x TP, remat", tp, remat)]
                                                    if measure_temp else [])
    except Unavailable:
        pass
    for name, strategy, problem in strategies:
        entries[name] = _memory(strategy, problem, measure_temp)
    out: dict[str, Any] = {"model": spec.name, "layers": spec.layers, "batch": spec.batch,
                           "entries": entries}
    if "FSDP x TP" in entries:
        n = len(devices)
        ratio = entries["FSDP x TP"]["state_bytes"] / entries["Mirrored"]["state_bytes"]
        out["tp_state_fraction_of_mirrored"] = ratio
        out["tp_state_target"] = 1 / n + 0.05
        out["tp_state_pass"] = ratio <= 1 / n + 0.05
    return out


def add_process_entries(table: dict, entries: dict) -> None:
    """Add multi-process layouts (`benchmarks.multiproc.lm_hsdp_rows`: per-device state bytes, the
    whole state's bytes and the target fraction) to a `memory_table`, with their verdicts in
    ``process_targets``."""
    mirrored = table["entries"]["Mirrored"]["state_bytes"]
    table.setdefault("process_targets", {})
    for name, e in entries.items():
        table["entries"][name] = {"param_bytes": None, "optimizer_bytes": None,
                                  "state_bytes": e["state_bytes"], "temp_bytes": None}
        fraction = e["state_bytes"] / mirrored
        table["process_targets"][name] = {"fraction": fraction, "target": e["target"],
                                          "pass": fraction <= e["target"]}
