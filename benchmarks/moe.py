"""Mixture of experts: `jd.nn.MoE` under expert parallelism, against MaxText's dropping MoE written
by hand.

A small MoE language model (token embedding; ``layers`` blocks ``x + MoE(LayerNorm(x))`` of
`jd.nn.MoE` with SwiGLU experts, top-k softmax routing, a capacity per sequence (tokens past it
drop) and the Switch load-balancing loss; a final LayerNorm and a vocabulary head; Adam) on 8
simulated CPU devices. Three measurements, all in one run:

(a) **Expert state per device.** Expert weights (``wi_gate``, ``wi_up``, ``wo``) and their Adam
    moments on ``ShardedStrategy(mesh=(data=2, expert=4), batch_axes=("data", "expert"),
    expert_axes="expert")``: per-device bytes over the whole arrays' bytes, from the step's `Plan`
    (``strategy.jit(step).plan(...)``: its ``largest_arrays``, which lists ten arrays at most, and
    ``state_bytes`` for the whole state) and measured from the placed arrays' ``addressable_shards``
    (the most any one device holds). Expected for the expert arrays: ``1 / EP``. The same for the EP
    = 1 strategy (``mesh=(data=8,)``, ``batch_axes="data"``, ``fsdp_axes=()``: experts replicated).
(b) **All-to-all bytes per layer.** ``Plan.collectives["all-to-all"]`` of the compiled training step
    (count and bytes; per op and per layer), against two analytic figures per direction: the tokens
    actually routed, ``tokens_per_device * top_k * d * bytes`` (sent: ``x (EP - 1) / EP``), and the
    fixed capacity buffers the dropping path exchanges, ``rows_per_device * E * capacity * d *
    bytes``. Also for the dropless layer (``capacity_factor=None``: capacity = the sequence) and for
    the hand-written program (its compiled HLO read by `jaxdist.costs.program_cost`).
(c) **Step time.** ``strategy.jit`` of the LM with `jd.nn.MoE` on ``(data=2, expert=4)`` against (1)
    the same model written the MaxText "dropping" way by hand (``generate_masks`` /
    ``dense_matmul``: dense 0/1 dispatch and combine einsums with a capacity, the expert buffers
    ``(E, B, C, d)`` and stacked expert weights split over ``"expert"`` by
    ``jax.lax.with_sharding_constraint`` / ``NamedSharding``, a hand-written ``jax.jit`` with in/out
    shardings and donated state on the same devices; GSPMD inserts the collectives), and (2) the
    same `jd.nn.MoE` LM at EP = 1 (``mesh=(data=8,)``, experts replicated). Alternating blocks
    (`benchmarks.timing`); ratio = steps/s of ``jd.nn.MoE`` on (2, 4) / steps/s of the baseline.
    Before timing, both sides of each pair run two steps from the same initial state and their
    losses must agree to rtol 1e-4 (the second loss checks the gradients and the Adam update too).

Run: ``python -m benchmarks.moe`` (``--smoke``: tiny sizes, seconds). Writes
``benchmarks/results/<date>-<backend>-moe.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
LOSS_RTOL = 1e-4
EXPERT_ARRAY = re.compile(r"MoE_\d+\W+(wi_gate|wi_up|wo)\b")
"""An expert weight (or its Adam moment) in a key path (``['MoE_0']['wi_up']``) or a plan path
(``MoE_0/wo``)."""


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The LM and its batch."""

    vocab: int = 256
    d_model: int = 128
    hidden: int = 256  # each expert's hidden width
    experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    layers: int = 2
    rows: int = 32  # global batch: sequences
    length: int = 64


SMOKE = Sizes(vocab=32, d_model=16, hidden=32, rows=8, length=8)
EP_MESH = ((2, 4), ("data", "expert"))
EP1_MESH = ((8,), ("data",))


# -------------------------------------------------------------------------------------------- model
def _lm(sizes: Sizes, capacity_factor: float | None, ragged: bool | None = None,
        dtype: Any = None) -> Any:
    import flax.linen as nn

    import jaxdist as jd

    class MoELM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(sizes.vocab, sizes.d_model, dtype=dtype)(tokens)
            for _ in range(sizes.layers):
                x = x + jd.nn.MoE(num_experts=sizes.experts, top_k=sizes.top_k,
                                  hidden_dim=sizes.hidden,
                                  capacity_factor=capacity_factor, ragged=ragged, dtype=dtype)(
                    nn.LayerNorm(dtype=dtype)(x))
            return nn.Dense(sizes.vocab,
                            dtype=dtype)(nn.LayerNorm(dtype=dtype)(x)).astype(jnp.float32)

    return MoELM()


def _cross_entropy(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()


def _train_step(loss_fn: Callable, tx: Any) -> Callable:
    import optax

    def step(params: Any, opt_state: Any, tokens: jax.Array) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def jd_step(sizes: Sizes, tx: Any, capacity_factor: float | None, ragged: bool | None = None,
            dtype: Any = None) -> Callable:
    """The training step of the `jd.nn.MoE` LM (cross-entropy + the layers' sown auxiliary loss)."""
    import jaxdist as jd

    model = _lm(sizes, capacity_factor, ragged, dtype)

    def loss_fn(params: Any, tokens: jax.Array) -> jax.Array:
        logits, sown = model.apply(params, tokens, mutable=["moe_losses"])
        return _cross_entropy(logits, tokens) + jd.nn.moe_loss(sown)

    return _train_step(loss_fn, tx)


# ------------------------------------------------------------------------ the MaxText way, by hand
def expert_capacity(sizes: Sizes) -> int:
    """Tokens each expert takes per sequence: ``ceil(capacity_factor * length * top_k / E)`` (at
    most the length; MaxText floors, jd.nn.MoE rounds up: the hand-written model follows jd.nn.MoE
    to compute the same function)."""
    return min(sizes.length,
               max(1,
                   math.ceil(sizes.capacity_factor * sizes.length * sizes.top_k / sizes.experts)))


def _layer_norm(x: jax.Array, p: dict) -> jax.Array:
    """Flax ``nn.LayerNorm`` (epsilon 1e-6, fast variance)."""
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.maximum(0.0, jnp.mean(x * x, -1, keepdims=True) - mean * mean)
    return (x - mean) * (jax.lax.rsqrt(var + 1e-6) * p["scale"]) + p["bias"]


def hand_loss(sizes: Sizes, mesh: jax.sharding.Mesh) -> Callable:
    """The LM's loss written MaxText's dropping way (``RoutedMoE.generate_masks`` +
    ``dense_matmul``), on the unboxed parameter tree of the `jd.nn.MoE` LM.

    Routing: top-k of the router logits, softmax over the k picked (= the full softmax's top k,
    renormalised); each pick's slot in its expert's buffer by a cumulative sum over the sequence's
    (position, rank) picks; picks past ``capacity`` drop. Dispatch ``BSM,BSEC->EBCM`` and combine
    ``EBCM,BSEC->BSM`` are dense einsums; the buffers are constrained to experts over ``"expert"``
    and rows over ``"data"``; GSPMD chooses the collectives that move the tokens between the batch
    layout and the experts' devices (table (b) shows which).
    """
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    e, k, cap = sizes.experts, sizes.top_k, expert_capacity(sizes)
    # (E, B, C, M): MaxText's ("activation_exp", batch w/o exp)
    buffers = NamedSharding(mesh, P("expert", "data"))
    rows = NamedSharding(mesh, P(("data", "expert")))

    def moe(x: jax.Array, p: dict) -> tuple[jax.Array, jax.Array]:
        b, s, _ = x.shape
        logits = jnp.einsum("bsm,me->bse", x.astype(jnp.float32), p["router"].astype(jnp.float32))
        top_logits, top_experts = jax.lax.top_k(logits, k)
        weights = jax.nn.softmax(top_logits, -1)  # (b, s, k)
        mask = jax.nn.one_hot(top_experts, e, dtype=jnp.int32)  # (b, s, k, e)
        # 1-based slot
        count = jnp.cumsum(mask.reshape(b, s * k, e), axis=1).reshape(b, s, k, e) * mask
        keep = mask * (count <= cap)
        # (b, s, e): 1-based slot, 0 = not routed there or dropped
        slot = jnp.sum(count * keep, axis=2)
        dispatch = jax.nn.one_hot(slot, cap + 1, dtype=x.dtype)[..., 1:]  # (b, s, e, c)
        combine = jnp.sum(weights[..., None] * keep, axis=2).astype(x.dtype)[..., None] * dispatch
        # share of tokens per expert
        density = jnp.mean(jnp.sum(mask, axis=2).astype(jnp.float32), axis=(0, 1))
        probs = jnp.mean(jax.nn.softmax(logits, -1), axis=(0, 1))
        aux = jnp.mean(density * probs) * (e * e / k)  # MaxText's load_balance_loss = Switch's
        h = jax.lax.with_sharding_constraint(jnp.einsum("bsm,bsec->ebcm", x, dispatch), buffers)
        gate = jnp.einsum("ebcm,emh->ebch", h, p["wi_gate"])
        up = jnp.einsum("ebcm,emh->ebch", h, p["wi_up"])
        out = jax.lax.with_sharding_constraint(jnp.einsum("ebch,ehm->ebcm", jax.nn.silu(gate) * up,
                                                          p["wo"]),
                                               buffers)
        return jax.lax.with_sharding_constraint(jnp.einsum("ebcm,bsec->bsm", out, combine),
                                                rows), aux

    def loss_fn(params: Any, tokens: jax.Array) -> jax.Array:
        p = params["params"]
        x = jnp.take(p["Embed_0"]["embedding"], tokens, axis=0)
        aux = jnp.float32(0)
        for i in range(sizes.layers):
            y, a = moe(_layer_norm(x, p[f"LayerNorm_{i}"]), p[f"MoE_{i}"])
            x, aux = x + y, aux + 0.01 * a  # jd.nn.MoE's default load_balance_weight
        x = _layer_norm(x, p[f"LayerNorm_{sizes.layers}"])
        logits = x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"]
        return _cross_entropy(logits, tokens) + aux

    return loss_fn


# (path regex, spec, min elements): experts over "expert"; embedding, routers, head FSDP-split
HAND_LAYOUTS = (
    (EXPERT_ARRAY, ("expert",), 0),
    (re.compile(r"Embed_0\W+embedding|MoE_\d+\W+router"), (("data", "expert"),), 1024),
    (re.compile(r"Dense_0\W+kernel"), (None, ("data", "expert")), 1024),
)


def hand_shardings(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """The hand-written layouts of a parameter (or Adam state) tree, by path: the first rule of
    `HAND_LAYOUTS` that matches (for an array of at least its elements), else replicated."""
    from jax.sharding import NamedSharding, PartitionSpec

    def one(path: Any, leaf: Any) -> NamedSharding:
        name, size = jax.tree_util.keystr(path), math.prod(np.shape(leaf))
        spec = next((s for pattern, s, least in HAND_LAYOUTS if pattern.search(name)
                     and size >= least), ())
        return NamedSharding(mesh, PartitionSpec(*spec))

    return jax.tree_util.tree_map_with_path(one, tree)


# ----------------------------------------------------------------------------------------- steppers
class Stepper:
    """``params, opt_state, loss = step(params, opt_state, tokens)`` on one fixed placed batch."""

    step_multiple = 1
    min_block_steps = 1
    min_block_seconds = 0.0

    def __init__(self, jitted: Any, state: tuple[Any, Any], tokens: jax.Array):
        self.jitted, self.state, self.tokens = jitted, state, tokens

    def losses(self, steps: int) -> list[float]:
        """Run ``steps`` steps, returning each one's loss (the first: the loss at the initial
        state)."""
        out = []
        for _ in range(steps):
            *state, loss = self.jitted(*self.state, self.tokens)
            self.state = tuple(state)
            out.append(float(loss))
        return out

    def run(self, steps: int) -> None:
        state, loss = self.state, None
        for _ in range(steps):
            *state, loss = self.jitted(*state, self.tokens)
        jax.block_until_ready((state, loss))
        self.state = tuple(state)

    def close(self) -> None:
        self.state = None


def host_start(sizes: Sizes, tx: Any) -> tuple[Any, np.ndarray]:
    """The initial parameters (host numpy, Flax boxes kept; the ``"params"`` collection only) and
    the batch."""
    tokens = np.random.default_rng(0).integers(0, sizes.vocab,
                                               (sizes.rows, sizes.length)).astype(np.int32)
    variables = jax.jit(_lm(sizes, sizes.capacity_factor).init)(jax.random.key(0), tokens[:2])
    return jax.device_get({"params": variables["params"]}), tokens


def strategy(ep: bool) -> Any:
    """``(data=2, expert=4)`` with expert axes, or EP = 1 on ``(data=8,)``: the constructors of the
    brief."""
    import jaxdist as jd

    if ep:
        return jd.ShardedStrategy(mesh=jax.make_mesh(*EP_MESH), batch_axes=("data", "expert"),
                                  expert_axes="expert")
    # EP = 1: every device holds every expert (and every other variable) whole, as data parallelism
    # does.
    return jd.ShardedStrategy(mesh=jax.make_mesh(*EP1_MESH), batch_axes="data", fsdp_axes=())


def jd_stepper(
    sizes: Sizes, host: Any, tokens: np.ndarray, tx: Any, ep: bool
) -> tuple[Stepper, Any]:
    """``strategy.jit`` of the `jd.nn.MoE` step (donated state); returns the stepper and its
    strategy."""
    s = strategy(ep)
    params = s.create_variables(lambda: host)
    opt_state = s.create_variables(tx.init, params)
    jitted = s.jit(jd_step(sizes, tx, sizes.capacity_factor), batch_argnums=2,
                   donate_argnums=(0, 1))
    return Stepper(jitted, (params, opt_state), s.experimental_distribute_values(tokens)), s


def hand_stepper(sizes: Sizes, host: Any, tokens: np.ndarray, tx: Any) -> Stepper:
    """Hand-written ``jax.jit`` of the MaxText-style step on the (data=2, expert=4) devices (Auto
    axes: the step is unannotated, as MaxText's), in/out shardings of `hand_shardings`, batch split
    over both axes."""
    import flax.linen as nn
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh(*EP_MESH, axis_types=(jax.sharding.AxisType.Auto,) * 2)
    params = nn.unbox(host)
    param_layouts = hand_shardings(params, mesh)
    opt_layouts = hand_shardings(jax.eval_shape(tx.init, params), mesh)
    split = NamedSharding(mesh, PartitionSpec(("data", "expert")))
    placed = jax.device_put(params, param_layouts)
    opt_state = jax.jit(tx.init, out_shardings=opt_layouts)(placed)
    jitted = jax.jit(
        _train_step(hand_loss(sizes, mesh), tx),
        in_shardings=(param_layouts, opt_layouts, split),
        out_shardings=(param_layouts, opt_layouts, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=(0, 1),
    )
    return Stepper(jitted, (placed, opt_state), jax.device_put(tokens, split))


# --------------------------------------------------------------------------------- (a) expert state
def _leaves(tree: Any, expert: bool) -> list[jax.Array]:
    return [x for p, x in jax.tree_util.tree_leaves_with_path(tree)
            if bool(EXPERT_ARRAY.search(jax.tree_util.keystr(p))) == expert]


def _per_device(arrays: Sequence[jax.Array]) -> int:
    """The most bytes any one device holds of ``arrays`` (their addressable shards)."""
    per: dict[Any, int] = {}
    for a in arrays:
        for shard in a.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return max(per.values(), default=0)


def _specs(arrays: Sequence[jax.Array]) -> list[str]:
    return sorted({str(a.sharding.spec) for a in arrays})


def state_row(name: str, ep: int, state: tuple[Any, Any], plan: Any) -> dict[str, Any]:
    """Expert weights + Adam moments, and the whole state, per device against their whole bytes."""
    experts = _leaves(state, True)
    listed = [a for a in plan.largest_arrays if EXPERT_ARRAY.search(a.path)]
    every = jax.tree.leaves(state)
    return {
        "name": name, "ep": ep, "expert_layouts": _specs(experts), "expert_arrays": len(experts),
        "expert_total_bytes": sum(a.nbytes for a in experts),
        "expert_measured_bytes": _per_device(experts),
        "plan_listed_expert_arrays": len(listed),
        "plan_listed_expert_bytes": sum(a.bytes for a in listed),
        "plan_listed_expert_total_bytes": sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize
                                              for a in listed),
        "state_total_bytes": sum(a.nbytes for a in every),
        "state_measured_bytes": _per_device(every),
        "state_plan_bytes": (plan.state_bytes.get("params", 0)
                             + plan.state_bytes.get("opt_state", 0)),
    }


# ----------------------------------------------------------------------------------- (b) all-to-all
def analytic_all_to_all(sizes: Sizes, capacity: int, devices: int, ep: int,
                        itemsize: int = 4) -> dict[str, float]:
    """Per device, per layer, each way: the routed tokens' bytes and the capacity buffers' bytes,
    both as the buffer a device hands the all-to-all and as what it sends (``(EP - 1) / EP`` of
    that)."""
    rows = sizes.rows // devices
    tokens = rows * sizes.length * sizes.top_k * sizes.d_model * itemsize
    buffers = rows * sizes.experts * capacity * sizes.d_model * itemsize
    return {"token_bytes": tokens, "token_sent": tokens * (ep - 1) / ep, "buffer_bytes": buffers,
            "buffer_sent": buffers * (ep - 1) / ep}


def all_to_all_row(
    name: str, sizes: Sizes, capacity: int, collectives: dict[str, Any]
) -> dict[str, Any]:
    """The measured all-to-alls of one compiled step (``{kind: (count, bytes, wire_bytes)}``) per
    layer and per op, beside the analytic figures."""
    count, total, sent = collectives.get("all-to-all", (0, 0, 0.0))
    row = {"name": name, "capacity": capacity, "count": count, "per_layer": count / sizes.layers,
           "bytes_per_op": total / count if count else 0.0,
           "sent_per_op": sent / count if count else 0.0,
           "collectives": {k: {"count": c, "bytes": b, "sent": w}
                           for k, (c, b, w) in collectives.items()}}
    row.update(analytic_all_to_all(sizes, capacity, 8, 4))
    return row


def _plan_collectives(plan: Any) -> dict[str, tuple[int, int, float]]:
    return {k: (c.count, c.bytes, c.wire_bytes) for k, c in plan.collectives.items()}


def _hlo_cost(stepper: Stepper) -> tuple[dict[str, tuple[int, int, float]], float]:
    """The hand-written program's collectives and FLOPs per device, read from its compiled HLO as a
    `Plan` reads jaxdist's."""
    from jaxdist.costs import program_cost

    compiled = stepper.jitted.lower(*stepper.state, stepper.tokens).compile()
    mesh = stepper.tokens.sharding.mesh
    cost = program_cost(compiled, axis_names=mesh.axis_names, axis_sizes=tuple(mesh.shape.values()))
    out: dict[str, list] = {}
    for op in cost.collectives:
        c = out.setdefault(op.kind, [0, 0, 0.0])
        c[0] += op.times
        c[1] += op.times * op.bytes
        c[2] += op.times * op.wire_bytes
    return {k: tuple(v) for k, v in out.items()}, cost.flops


# ------------------------------------------------------------------------------------------ run all
def measure(sizes: Sizes, pairs: int, block_seconds: float) -> dict[str, Any]:
    """Every row: (a) and (b) from the plans and placed arrays, the loss checks, then (c) timed."""
    import optax

    from benchmarks.timing import Settings, calibrate, measure_pair, spread

    tx = optax.adam(1e-3)
    host, tokens = host_start(sizes, tx)
    cap = expert_capacity(sizes)
    ep4, s4 = jd_stepper(sizes, host, tokens, tx, ep=True)
    ep1, _ = jd_stepper(sizes, host, tokens, tx, ep=False)
    hand = hand_stepper(sizes, host, tokens, tx)
    same_layouts = all(
        a.sharding.spec == b.sharding.spec for a, b in zip(jax.tree.leaves(ep4.state),
                                                           jax.tree.leaves(hand.state),
                                                           strict=True))
    plan4 = ep4.jitted.plan(*ep4.state, tokens)
    plan1 = ep1.jitted.plan(*ep1.state, tokens)
    state = [state_row("jd.nn.MoE, (data=2, expert=4)", 4, ep4.state, plan4),
             state_row("jd.nn.MoE, EP=1 (data=8)", 1, ep1.state, plan1)]
    print("(a) expert state measured", file=sys.stderr)

    dropless = s4.jit(jd_step(sizes, tx, None), batch_argnums=2).plan(*ep4.state, tokens)
    hand_collectives, hand_flops = _hlo_cost(hand)
    flops = {"ep4": plan4.flops, "ep1": plan1.flops, "hand": hand_flops}
    a2a = [all_to_all_row(f"jd.nn.MoE, capacity_factor={sizes.capacity_factor}", sizes, cap,
                          _plan_collectives(plan4)),
           all_to_all_row("jd.nn.MoE, dropless (capacity_factor=None)", sizes, sizes.length,
                          _plan_collectives(dropless)),
           all_to_all_row("hand-written MaxText dropping (GSPMD), "
                          f"capacity_factor={sizes.capacity_factor}", sizes,
                          cap, hand_collectives)]
    print("(b) all-to-alls read", file=sys.stderr)

    checks = {}
    losses = {name: s.losses(2) for name, s in (("ep4", ep4), ("ep1", ep1), ("hand", hand))}
    for base in ("hand", "ep1"):
        got, want = np.array(losses["ep4"]), np.array(losses[base])
        rel = float(np.max(np.abs(got - want) / np.abs(want)))
        checks[base] = {"ep4_losses": losses["ep4"], "baseline_losses": losses[base],
                        "max_rel_diff": rel, "ok": rel <= LOSS_RTOL}
    print(f"loss checks: {checks}", file=sys.stderr)
    if not all(c["ok"] for c in checks.values()):
        raise AssertionError(f"the baselines do not compute the same function (rtol {LOSS_RTOL}): "
                             f"{checks}")

    settings = Settings(pairs=pairs, block_seconds=block_seconds, warmup_steps=3, min_steps=1)
    per_step = {
        name: calibrate(s, settings) for name, s in (("ep4", ep4), ("ep1", ep1), ("hand", hand))
    }
    times = []
    for base, label, stepper in (("hand",
                                  "hand-written MaxText dropping, jax.jit (data=2, expert=4)",
                                  hand),
                                 ("ep1", "jd.nn.MoE, EP=1 (data=8)", ep1)):
        result = measure_pair(ep4, stepper, settings, (per_step["ep4"], per_step[base]))
        ratio = spread(result.ratios)
        times.append({"baseline": label, "key": base, "ratio": dataclasses.asdict(ratio),
                      "steps_per_sec": float(np.median(result.rates_a)),
                      "baseline_steps_per_sec": float(np.median(result.rates_b)),
                      "steps_per_block": result.steps,
                      "flops_per_device": flops["ep4"], "baseline_flops_per_device": flops[base],
                      "loss_check": checks[base], "blocks": dataclasses.asdict(result)})
        print(f"(c) vs {base}: {ratio.median:.3f}", file=sys.stderr)
    for s in (ep4, ep1, hand):
        s.close()
    return {"capacity": cap, "same_layouts_as_hand": same_layouts, "state": state,
            "all_to_all": a2a, "step_time": times}


# ------------------------------------------------------------------------------------------- report
def _kib(n: float) -> str:
    return f"{n / 1024:,.1f}"


def markdown(sizes: Sizes, result: dict[str, Any], machine: dict[str, Any]) -> str:
    """The three tables."""
    cap = result["capacity"]
    lines = [f"# Mixture of experts: jd.nn.MoE ({machine['date'][:10]}, {machine['backend']} x "
             f"{machine['device_count']})", "",
             f"LM: vocab {sizes.vocab}, d_model {sizes.d_model}, {sizes.layers} MoE layers of "
             f"{sizes.experts} SwiGLU experts (hidden {sizes.hidden}), top-{sizes.top_k} softmax "
             f"routing, capacity factor {sizes.capacity_factor} per sequence (capacity {cap}), "
             f"Switch loss 0.01, Adam; batch {sizes.rows} x {sizes.length} tokens, fp32.", "",
             "## (a) Expert weights + Adam moments per device / their whole bytes", "",
             "Plan: `strategy.jit(step).plan(...)` (`largest_arrays`, ten arrays at most: the "
             "expert arrays among them; `state_bytes` params + opt_state for the whole state). "
             "Measured: the most bytes one device holds of the placed arrays' "
             "`addressable_shards`.", "",
             "| strategy | expert layout | 1/EP | plan (arrays listed) | measured (all expert "
             "arrays) | expert KiB / device (measured) | whole state: plan | whole state: measured "
             "|",
             "|---|---|---|---|---|---|---|---|"]
    notes = []
    for r in result["state"]:
        listed = r["plan_listed_expert_arrays"]
        plan = (f"{r['plan_listed_expert_bytes'] / r['plan_listed_expert_total_bytes']:.4f} "
                f"({listed} of {r['expert_arrays']})") if listed else "-"
        lines.append(f"| {r['name']} | {', '.join(r['expert_layouts'])} | {1 / r['ep']:.4f} | "
                     f"{plan} | {r['expert_measured_bytes'] / r['expert_total_bytes']:.4f} | "
                     f"{_kib(r['expert_measured_bytes'])} of {_kib(r['expert_total_bytes'])} | "
                     f"{r['state_plan_bytes'] / r['state_total_bytes']:.4f} | "
                     f"{r['state_measured_bytes'] / r['state_total_bytes']:.4f} |")
        if abs(r["expert_measured_bytes"] / r["expert_total_bytes"] - 1 / r["ep"]) > 1e-9:
            notes.append(f"{r['name']}: the expert arrays are laid out "
                         f"{', '.join(r['expert_layouts'])}, not 1/EP (split by the FSDP rule, not "
                         "by expert parallelism).")
    lines += ["", *notes] if notes else []
    lines += ["", "## (b) All-to-all per device, per layer, each way", "",
              "Measured: the compiled step's all-to-alls (jd.nn.MoE: "
              "`Plan.collectives['all-to-all']`; hand-written: its HLO through `jd.program_cost`), "
              "bytes = the buffer each device hands one op, sent = (EP-1)/EP of it. Token-based: "
              "`tokens/device * top_k * d * 4`; buffer-based: `rows/device * E * capacity * d * "
              "4`. A training step runs 4 per layer: there and back, forward and backward.", "",
              "| program | capacity | all-to-alls / layer / step | measured KiB / op (sent) | "
              "token-based KiB (sent) | buffer-based KiB (sent) | measured / token-based | "
              "measured / buffer-based | matches | other collectives / step (count, KiB) | all "
              "collectives: KiB sent / step |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["all_to_all"]:
        others = "; ".join(f"{k} {v['count']}, {_kib(v['bytes'])}"
                           for k, v in r["collectives"].items()
                           if k != "all-to-all")
        sent = sum(v["sent"] for v in r["collectives"].values())
        if r["count"]:
            ratio_t, ratio_b = (r["bytes_per_op"] / r["token_bytes"],
                                r["bytes_per_op"] / r["buffer_bytes"])
            matches = " and ".join(n for n, q in (("token-based", ratio_t),
                                                  ("buffer-based", ratio_b))
                                   if abs(q - 1) < 1e-3) or "neither"
            ratio_t, ratio_b = f"{ratio_t:.3f}", f"{ratio_b:.3f}"
            measured = f"{_kib(r['bytes_per_op'])} ({_kib(r['sent_per_op'])})"
        else:
            ratio_t = ratio_b = measured = "no all-to-all"
            matches = "-"
        lines.append(f"| {r['name']} | {r['capacity']} | {r['per_layer']:g} | {measured} | "
                     f"{_kib(r['token_bytes'])} ({_kib(r['token_sent'])}) | "
                     f"{_kib(r['buffer_bytes'])} ({_kib(r['buffer_sent'])}) | {ratio_t} | "
                     f"{ratio_b} | {matches} | {others} | {_kib(sent)} |")
    lines += ["", "## (c) Step time: jd.nn.MoE on (data=2, expert=4) / baseline", "",
              "Median of alternating pairs with its 95% interval (> 1: jd.nn.MoE is faster). Loss "
              "check: both sides' first two losses from the same initial state, max relative "
              f"difference (tolerance {LOSS_RTOL}). Hand-written layouts equal the strategy's "
              f"placed state: {result['same_layouts_as_hand']}.", "",
              "| baseline | ratio | 95% interval | jd.nn.MoE steps/s | baseline steps/s | steps / "
              "block | pairs | loss check | MFLOP / device / step: jd.nn.MoE, baseline (compiled "
              "HLO) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in result["step_time"]:
        q, c = r["ratio"], r["loss_check"]
        lines.append(f"| {r['baseline']} | {q['median']:.3f} | [{q['ci_low']:.3f}, "
                     f"{q['ci_high']:.3f}] | {r['steps_per_sec']:.1f} | "
                     f"{r['baseline_steps_per_sec']:.1f} | {r['steps_per_block']} | {q['n']} | "
                     f"{c['max_rel_diff']:.1e} ({'ok' if c['ok'] else 'FAILED'}) | "
                     f"{r['flops_per_device'] / 1e6:.1f}, "
                     f"{r['baseline_flops_per_device'] / 1e6:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: measure, write ``.md`` and ``.json`` under ``--out``, print the table."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS,
                        help=f"results folder (default {RESULTS})")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes and 2 short pairs: does everything run?")
    parser.add_argument("--pairs", type=int, default=24,
                        help="pairs of blocks per step-time row (default 24)")
    parser.add_argument("--block-seconds", type=float, default=1.0,
                        help="seconds per block (default 1)")
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", 8)
    from benchmarks.report import machine_info, write_table

    sizes = SMOKE if args.smoke else Sizes()
    machine = machine_info(jax.devices())
    try:
        result = measure(sizes, 2 if args.smoke else args.pairs, 0.02 if args.smoke
                         else args.block_seconds)
    except Exception:
        traceback.print_exc()
        return 1
    table = markdown(sizes, result, machine)
    stem = f"{machine['date'][:10]}-{machine['backend']}-moe" + ("-smoke" if args.smoke else "")
    write_table(args.out, stem, table, {"machine": machine, "sizes": dataclasses.asdict(sizes),
                                        **result})
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
