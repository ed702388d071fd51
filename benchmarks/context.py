"""Context parallelism: memory per device against sequence length, and step time of the attention
modes.

Two measurements of the char LM of ``examples/char_lm.py`` (2 layers, d_model 128, 4 heads, SGD):

1. **Memory**: the compiled train step's per-device bytes (XLA ``memory_analysis()`` of
   ``strategy.jit(...).lower(...).compile()``: arguments, outputs, temporaries; peak = arguments +
   outputs + temporaries - aliased) at sequence ``CP x L0`` on a ``(context=CP)`` mesh, CP = 1, 2,
   4, 8, for each attention: ``jd.nn.dot_product_attention`` all-gather, ring, load-balanced ring,
   and the example's own attention (XLA gathers the sequence). Target: CP = N holds N x the sequence
   at <= 1.2 x the memory of CP = 1.
2. **Step time** on ``(data=2, context=4)``: ``strategy.jit`` with each attention against a
   hand-written ``jax.jit`` of the same model with the example's own attention (in/out shardings
   copied from the strategy's placed state, the batch split ``P("data", "context")``, traced under
   the mesh and the same logical rules, so XLA all-gathers K/V: MaxText's all-gather context
   parallelism), in alternating blocks (`benchmarks.timing`). Target for all-gather: >= 0.97.

Run: ``python -m benchmarks.context`` (``--smoke``: tiny sizes, seconds). Writes
``benchmarks/results/<date>-<backend><devices>-context.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
MODES = {  # name: (LMConfig.context, load_balance)
    "all_gather": ("all_gather", False),
    "ring": ("ring", False),
    "ring_balanced": ("ring", True),
    "xla": (None, False),  # the example's own attention: XLA gathers the split sequence
}
TARGET_MEMORY = 1.2
TARGET_TIME = 0.97


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The LM and the sequences measured."""

    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 2
    batch: int = 2
    base_len: int = 1024  # L0: the sequence at CP = 1 (memory)
    time_len: int = 2048  # the sequence of the step-time rows
    time_batch: int = 4


SMOKE = Sizes(d_model=16, num_heads=2, num_layers=1, batch=2, base_len=64, time_len=64,
              time_batch=4)


def _config(sizes: Sizes, seq_len: int, mode: str) -> Any:
    from benchmarks.lm import char_lm

    context, balance = MODES[mode]
    return char_lm().LMConfig(vocab_size=104, d_model=sizes.d_model, num_heads=sizes.num_heads,
                              num_layers=sizes.num_layers, mlp_dim=4 * sizes.d_model,
                              max_len=seq_len, context=context, load_balance=balance)


def _step(config: Any):
    from benchmarks.lm import char_lm

    lm = char_lm()
    model = lm.CharLM(config)

    def step(params: Any, batch: Any) -> Any:
        x, y = batch

        def loss(p):
            return lm.loss_fn(model.apply({"params": p}, x), y)

        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), value

    return model, step


def _strategy(mesh: jax.sharding.Mesh) -> Any:
    import jaxdist as jd

    batch_axes = tuple(a for a in mesh.axis_names if a != "context")
    return jd.ShardedStrategy(mesh=mesh, batch_axes=batch_axes, context_axes="context",
                              min_shard_size=1)


def _abstract_params(model: Any, seq_len: int) -> Any:
    import flax.linen as nn

    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, seq_len), jnp.int32))[
        "params"
    ]
    return nn.unbox(shapes)


# ------------------------------------------------------------------------------------------- memory
def memory(sizes: Sizes, cps: Sequence[int] = (1, 2, 4, 8)) -> list[dict[str, Any]]:
    """Per-device bytes of the compiled train step for each CP and attention (nothing runs)."""
    from jaxdist.costs import format_bytes

    rows = []
    for mode in MODES:
        for cp in cps:
            seq = cp * sizes.base_len
            mesh = jax.make_mesh((cp,), ("context",), axis_types=(jax.sharding.AxisType.Auto,),
                                 devices=jax.devices()[:cp])
            strategy = _strategy(mesh)
            model, step = _step(_config(sizes, seq, mode))
            shapes = _abstract_params(model, seq)
            params = jax.tree.map(
                lambda s, lay: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=lay),
                shapes,
                strategy.variable_shardings(shapes),
            )
            batch = tuple(jax.ShapeDtypeStruct((sizes.batch, seq), jnp.int32,
                                               sharding=strategy.policy.batch_layout(2))
                          for _ in range(2))
            analysis = (
                strategy.jit(step, batch_argnums=1).lower(params, batch).compile().memory_analysis()
            )
            arg, out = int(analysis.argument_size_in_bytes), int(analysis.output_size_in_bytes)
            temp, alias = int(analysis.temp_size_in_bytes), int(analysis.alias_size_in_bytes)
            rows.append({"mode": mode, "cp": cp, "seq_len": seq, "argument_bytes": arg,
                         "output_bytes": out,
                         "temp_bytes": temp, "peak_bytes": arg + out + temp - alias})
            print(f"memory {mode} cp={cp} L={seq}: peak {format_bytes(rows[-1]['peak_bytes'])}",
                  file=sys.stderr)
    for row in rows:
        base = next(r for r in rows if r["mode"] == row["mode"] and r["cp"] == 1)
        row["peak_vs_cp1"] = row["peak_bytes"] / base["peak_bytes"]
    return rows


# ---------------------------------------------------------------------------------------- step time
class _Stepper:
    step_multiple = 1
    min_block_steps = 1
    min_block_seconds = 0.0

    def __init__(self, jitted: Any, params: Any, batch: Any):
        self.jitted, self.params, self.batch = jitted, params, batch

    def run(self, steps: int) -> None:
        params, loss = self.params, None
        for _ in range(steps):
            params, loss = self.jitted(params, self.batch)
        jax.block_until_ready((params, loss))
        self.params = params

    def close(self) -> None:
        self.params = None


def _host_batch(sizes: Sizes) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 104, (sizes.time_batch, sizes.time_len + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def strategy_stepper(sizes: Sizes, mode: str) -> _Stepper:
    """``strategy.jit`` of the LM step with attention ``mode`` on ``(data=2, context=4)``."""
    strategy = _strategy(jax.make_mesh((2, 4), ("data", "context"),
                                       axis_types=(jax.sharding.AxisType.Auto,) * 2))
    model, step = _step(_config(sizes, sizes.time_len, mode))
    params = strategy.create_variables(lambda: _init(model, sizes.time_len))
    return _Stepper(strategy.jit(step, batch_argnums=1), params,
                    strategy.experimental_distribute_values(_host_batch(sizes)))


def _init(model: Any, seq_len: int) -> Any:
    import flax.linen as nn

    return nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, seq_len), jnp.int32))["params"])


def hand_stepper(sizes: Sizes) -> _Stepper:
    """Hand-written ``jax.jit`` + shardings of the same LM with the example's own attention (XLA
    all-gathers K/V along the context axis), traced under the mesh and the strategy's logical
    rules."""
    import flax.linen as nn
    from jax.sharding import NamedSharding, PartitionSpec

    strategy = _strategy(jax.make_mesh((2, 4), ("data", "context"),
                                       axis_types=(jax.sharding.AxisType.Auto,) * 2))
    model, step = _step(_config(sizes, sizes.time_len, "xla"))
    params = strategy.create_variables(lambda: _init(model, sizes.time_len))
    layouts = jax.tree.map(lambda a: a.sharding, params)
    split = NamedSharding(strategy.mesh, PartitionSpec("data", "context"))

    def traced(params: Any, batch: Any) -> Any:
        with jax.sharding.use_abstract_mesh(strategy.mesh.abstract_mesh), nn.logical_axis_rules(
                strategy.logical_axis_rules):
            return step(params, batch)

    jitted = jax.jit(traced, in_shardings=(layouts, (split, split)),
                     out_shardings=(layouts, NamedSharding(strategy.mesh, PartitionSpec())))
    return _Stepper(jitted, params, jax.device_put(_host_batch(sizes), (split, split)))


def step_times(sizes: Sizes, pairs: int, block_seconds: float) -> list[dict[str, Any]]:
    """Each attention's ``strategy.jit`` against the hand-written all-gather ``jax.jit``."""
    from benchmarks.timing import Settings, calibrate, measure_pair, spread

    settings = Settings(pairs=pairs, block_seconds=block_seconds, warmup_steps=2, min_steps=1)
    baseline = hand_stepper(sizes)
    base_time = calibrate(baseline, settings)
    rows = []
    for mode in MODES:
        candidate = strategy_stepper(sizes, mode)
        try:
            result = measure_pair(
                candidate, baseline, settings, (calibrate(candidate, settings), base_time)
            )
        finally:
            candidate.close()
        ratio = spread(result.ratios)
        rows.append({"mode": mode, "ratio": dataclasses.asdict(ratio),
                     "steps_per_sec": float(np.median(result.rates_a)),
                     "hand_steps_per_sec": float(np.median(result.rates_b)),
                     "steps_per_block": result.steps})
        print(f"time {mode}: {ratio.median:.3f} of hand-written", file=sys.stderr)
    baseline.close()
    return rows


# ------------------------------------------------------------------------------------------- report
def markdown(sizes: Sizes, mem: list[dict], times: list[dict], machine: dict) -> str:
    lines = [f"# Context parallelism ({machine['date'][:10]}, {machine['backend']} x "
             f"{machine['device_count']})", "",
             f"char LM: {sizes.num_layers} layers, d_model {sizes.d_model}, {sizes.num_heads} "
             "heads, SGD.", "",
             f"## Memory per device: sequence CP x {sizes.base_len}, batch {sizes.batch}, mesh "
             "(context=CP)", "",
             "| attention | CP | sequence | arguments MiB | temp MiB | peak MiB | peak / CP=1 | "
             f"target <= {TARGET_MEMORY} |", "|---|---|---|---|---|---|---|---|"]
    for r in mem:
        ok = "" if r["cp"] == 1 else ("met" if r["peak_vs_cp1"] <= TARGET_MEMORY else "missed")
        lines.append(f"| {r['mode']} | {r['cp']} | {r['seq_len']} | "
                     f"{r['argument_bytes'] / 2**20:.1f} | {r['temp_bytes'] / 2**20:.1f} | "
                     f"{r['peak_bytes'] / 2**20:.1f} | {r['peak_vs_cp1']:.2f} | {ok} |")
    lines += ["",
              f"## Step time on (data=2, context=4), batch {sizes.time_batch} x {sizes.time_len}",
              "",
              "`strategy.jit` with each attention / hand-written `jax.jit` + shardings with XLA's "
              "all-gather of K/V (median of pairs, 95% interval)", "",
              "| attention | ratio | 95% interval | steps/s | hand-written steps/s | target |",
              "|---|---|---|---|---|---|"]
    for r in times:
        q = r["ratio"]
        target = (f">= {TARGET_TIME}: {'met' if q['median'] >= TARGET_TIME else 'missed'}"
                  if r["mode"] in ("all_gather", "xla") else "")
        lines.append(f"| {r['mode']} | {q['median']:.3f} | [{q['ci_low']:.3f}, {q['ci_high']:.3f}] "
                     f"| {r['steps_per_sec']:.2f} | {r['hand_steps_per_sec']:.2f} | {target} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: measure, write ``.md`` and ``.json`` under ``--out``, print the table."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.context",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS,
                        help=f"results folder (default {RESULTS})")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes and 2 pairs: does everything run?")
    parser.add_argument("--pairs", type=int, default=8,
                        help="pairs of blocks per step-time row (default 8)")
    parser.add_argument("--block-seconds", type=float, default=2.0,
                        help="seconds per block (default 2)")
    parser.add_argument("--skip-time", action="store_true", help="memory only")
    parser.add_argument("--skip-memory", action="store_true", help="step time only")
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", 8)
    from benchmarks.report import machine_info, write_table

    sizes = SMOKE if args.smoke else Sizes()
    machine = machine_info(jax.devices())
    try:
        mem = [] if args.skip_memory else memory(sizes)
        times = [] if args.skip_time else step_times(sizes, 2 if args.smoke else args.pairs,
                                                     0.05 if args.smoke else args.block_seconds)
    except Exception:
        traceback.print_exc()
        return 1
    table = markdown(sizes, mem, times, machine)
    stem = f"{machine['date'][:10]}-{machine['backend']}{machine['device_count']}-context"
    stem += "-smoke" if args.smoke else ""
    write_table(args.out, stem, table, {"machine": machine, "sizes": dataclasses.asdict(sizes),
                                        "memory": mem, "step_time": times})
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
