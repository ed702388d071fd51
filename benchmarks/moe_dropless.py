"""Dropless mixture of experts: the ragged path against the worst-case buffer, tokens/s and MFU, on
this backend.

Issue row (d). The MoE LM of `benchmarks.moe` with ``capacity_factor=None`` (every token reaches its
experts), trained by ``strategy.jit`` on every device of the default backend: with expert
parallelism over all of them (``ShardedStrategy(mesh=(expert=N,), expert_axes="expert")``) where
there are several and they divide the experts, else on one device (every expert local). Two programs
of the same model, same initial state, same batch:

* **ragged** (``jd.nn.MoE(..., ragged=True)``): the picks sorted by expert, grouped matmuls
  (`jax.lax.ragged_dot`) and, with expert parallelism, `jax.lax.ragged_all_to_all` moving only the
  routed rows;
* **padded** (``ragged=False``): each expert's worst-case buffer (the whole sequence) through dense
  einsums and `jax.lax.all_to_all`.

Both run two steps first and their losses must agree (rtol 1e-4 in float32; 2e-2 in bfloat16). Then
alternating blocks (`benchmarks.timing`): ratio = steps/s of ragged / steps/s of padded; tokens/s;
achieved FLOP/s from each compiled step's own FLOP count (`Plan.flops`: per device, x devices); MFU
= achieved / peak where the device's dense bfloat16 peak is known (`jaxdist.costs.ACCELERATORS`) and
the model computes in bfloat16.

On CPU the numbers mean little and are labelled so: XLA:CPU has no ragged all-to-all (the exchange
runs emulated: padded bytes) and its ``ragged_dot`` is dense. The row is for GPUs and TPUs
(``device`` sessions): ``python -m benchmarks.moe_dropless --dtype bfloat16``. ``--smoke``: tiny
sizes, 8 simulated CPU devices. Writes ``benchmarks/results/<date>-<backend>-moe-dropless.md`` and
``.json``.
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

from benchmarks.moe import SMOKE, Sizes, Stepper, host_start, jd_step
from jaxdist.costs import known_peak_flops

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
ACCELERATOR = Sizes(vocab=2048, d_model=1024, hidden=2048, experts=8, top_k=2, layers=4, rows=16,
                    length=1024)
"""The model on a GPU / TPU: 16 x 1024 tokens a step, 8 SwiGLU experts of 1024 -> 2048 per layer, 4
layers."""


def strategy(sizes: Sizes) -> Any:
    """Expert parallelism over every device where there are several dividing the experts; else one
    device."""
    import jaxdist as jd

    n = jax.device_count()
    if n > 1 and sizes.experts % n == 0 and sizes.rows % n == 0:
        return jd.ShardedStrategy(mesh=jax.make_mesh((n,), ("expert",)), expert_axes="expert")
    return jd.OneDeviceStrategy()


def stepper(s: Any, sizes: Sizes, host: Any, tokens: np.ndarray, tx: Any, ragged: bool,
            dtype: Any) -> Stepper:
    params = s.create_variables(lambda: host)
    opt_state = s.create_variables(tx.init, params)
    jitted = s.jit(jd_step(sizes, tx, None, ragged, dtype), batch_argnums=2, donate_argnums=(0, 1))
    return Stepper(jitted, (params, opt_state), s.experimental_distribute_values(tokens))


def measure(sizes: Sizes, pairs: int, block_seconds: float, dtype: Any) -> dict[str, Any]:
    import optax

    from benchmarks.timing import Settings, calibrate, measure_pair, spread

    tx = optax.adam(1e-3)
    host, tokens = host_start(sizes, tx)
    s = strategy(sizes)
    sides = {name: stepper(s, sizes, host, tokens, tx, name == "ragged", dtype)
             for name in ("ragged", "padded")}
    plans = {name: side.jitted.plan(*side.state, tokens) for name, side in sides.items()}
    losses = {name: side.losses(2) for name, side in sides.items()}
    rtol = 1e-4 if dtype == jnp.float32 else 2e-2
    rel = float(
        np.max(np.abs(np.array(losses["ragged"]) - losses["padded"]) / np.abs(losses["padded"]))
    )
    if rel > rtol:
        raise AssertionError(f"ragged and padded dropless losses differ: {losses} (rtol {rtol})")
    settings = Settings(pairs=pairs, block_seconds=block_seconds, warmup_steps=3, min_steps=1)
    per_step = tuple(calibrate(side, settings) for side in sides.values())
    result = measure_pair(sides["ragged"], sides["padded"], settings, per_step)
    devices = jax.device_count()
    kind = jax.devices()[0].device_kind
    known = known_peak_flops(kind) if dtype == jnp.bfloat16 else None
    peak = known[0] if known else None
    rows = []
    for name, rates in (("ragged", result.rates_a), ("padded", result.rates_b)):
        steps_per_sec = float(np.median(rates))
        flops = plans[name].flops * devices * steps_per_sec
        rows.append({"path": name, "dispatch": list(plans[name].moe_dispatch),
                     "steps_per_sec": steps_per_sec,
                     "tokens_per_sec": steps_per_sec * sizes.rows * sizes.length,
                     "flops_per_step": plans[name].flops
                     * devices, "achieved_flops": flops, "mfu": flops / (peak * devices) if peak
                     else None, "all_to_all": plans[name].collectives.get("all-to-all")})
    for side in sides.values():
        side.close()
    return {"strategy": type(s).__name__, "devices": devices, "device_kind": kind,
            "dtype": jnp.dtype(dtype).name,
            "peak_bf16_per_device": peak, "losses": losses, "max_rel_loss_diff": rel,
            "ratio": dataclasses.asdict(spread(result.ratios)), "rows": rows,
            "blocks": dataclasses.asdict(result)}


def markdown(sizes: Sizes, result: dict[str, Any], machine: dict[str, Any]) -> str:
    q = result["ratio"]
    lines = [
        f"# Dropless MoE: ragged vs padded ({machine['date'][:10]}, {machine['backend']} x "
        f"{result['devices']} {result['device_kind']}, {result['dtype']})", "",
        f"{sizes.layers} MoE layers, {sizes.experts} experts, top-{sizes.top_k}, d_model "
        f"{sizes.d_model}, hidden {sizes.hidden}, {sizes.rows} x {sizes.length} tokens a step; "
        f"{result['strategy']}. Losses agree (max relative difference "
        f"{result['max_rel_loss_diff']:.1e}).", "",
        f"**ragged / padded steps/s: {q['median']:.3f} [{q['ci_low']:.3f}, {q['ci_high']:.3f}]** "
        f"(n={q['n']})", "",
        "| path | dispatch | steps/s | tokens/s | TFLOP/s achieved | MFU (bf16 dense peak) |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "- (peak unknown or not bfloat16)"
        lines.append(f"| {r['path']} | {', '.join(r['dispatch'])} | {r['steps_per_sec']:.2f} | "
                     f"{r['tokens_per_sec']:,.0f} | {r['achieved_flops'] / 1e12:.3f} | {mfu} |")
    if machine["backend"] == "cpu":
        lines += ["",
                  "CPU: the ragged exchange runs emulated (padded bytes) and `ragged_dot` is "
                  "dense: the row is for GPUs and TPUs."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe_dropless",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS,
                        help=f"results folder (default {RESULTS})")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, 8 simulated CPU devices, 2 short pairs")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the model's compute")
    parser.add_argument("--pairs", type=int, default=12, help="pairs of blocks (default 12)")
    parser.add_argument("--block-seconds", type=float, default=1.0,
                        help="seconds per block (default 1)")
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", 8)
    from benchmarks.report import machine_info, write_table

    sizes = SMOKE if args.smoke or jax.default_backend() == "cpu" else ACCELERATOR
    machine = machine_info(jax.devices())
    try:
        result = measure(sizes, 2 if args.smoke else args.pairs, 0.02 if args.smoke
                         else args.block_seconds, jnp.dtype(args.dtype))
    except Exception:
        traceback.print_exc()
        return 1
    table = markdown(sizes, result, machine)
    stem = f"{machine['date'][:10]}-{machine['backend']}-moe-dropless" + (
        "-smoke" if args.smoke else ""
    )
    write_table(args.out, stem, table, {"machine": machine, "sizes": dataclasses.asdict(sizes),
                                        **result})
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
