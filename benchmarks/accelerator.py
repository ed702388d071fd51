"""One prepared accelerator run: ``python -m benchmarks.accelerator`` on whatever single device it
finds.

Five parts, one table (``benchmarks/results/<date>-<backend>-accelerator[-smoke].md`` and
``.json``):

1. **Per-call rows** of the suite (`benchmarks.cases`: ``P1``, ``1dev``, ``fsdp``, ``trainer``) on
   the small and large MLP, on this one device: steps/s of jaxdist over the hand-written baseline
   (alternating blocks).
2. **A GPT-style LM through the Trainer**: 12 layers, d_model 1,024, 16 heads, MLP 4,096, vocabulary
   32,768, learned positions, tied head (185.6M parameters), 16 x 1,024 tokens a step, bfloat16
   compute with float32 parameters and AdamW state. Twice: attention by
   ``jd.nn.dot_product_attention`` and by ``jax.nn.dot_product_attention(implementation="cudnn")``
   written by hand (``"xla"`` off NVIDIA GPUs). Each row: steps/s, tokens/s, the Trainer's ``mfu``
   and ``hfu`` (FLOPs from `jaxdist.costs.program_cost`), and MFU from the analytic count (6 N + 12
   L d T) x tokens (PaLM, appendix B; attention counted whole).
3. **Plan against the device**: ``Trainer.plan(batch).peak_bytes`` against ``peak_bytes_in_use``
   after the first LM's steps (where the device keeps memory statistics: GPU, TPU).
4. **Dropless MoE**: the ragged path against the worst-case padded one (`benchmarks.moe_dropless`),
   tokens/s and MFU, bfloat16 on an accelerator.
5. **Attention kernels**, forward + backward, causal, 16 x 1,024 x 16 heads x 64, bfloat16: TFLOP/s
   from the analytic FLOPs (3 x 4 B H T^2 D, not halved for the mask) for
   ``jd.nn.dot_product_attention``, ``jax.nn.dot_product_attention`` with ``"xla"`` and ``"cudnn"``,
   and ``tokamax.dot_product_attention`` where tokamax is installed; with `program_cost`'s count of
   each program beside it.

On CPU the run uses tiny sizes and says so: the numbers check that everything runs, nothing more (no
peak, so no MFU). ``--smoke`` forces that mode anywhere. Runs on jax 0.11.2 (the device image) and
later.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxdist as jd
from benchmarks import moe, moe_dropless
from benchmarks.cases import COMPARISONS, Devices
from benchmarks.models import LARGE, SMALL, TINY
from benchmarks.report import machine_info, write_table
from benchmarks.suite import Row, run_plan
from benchmarks.timing import Settings

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
ROWS = ("P1", "1dev", "fsdp", "trainer")
PARTS = ("rows", "lm", "moe", "attention")


@dataclasses.dataclass(frozen=True)
class LMSizes:
    """The GPT-style LM and its batch."""

    layers: int
    d_model: int
    heads: int
    hidden: int
    vocab: int
    rows: int
    length: int

    @property
    def tokens(self) -> int:
        """Tokens a step."""
        return self.rows * self.length


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a run's sizes depend on: the accelerator's, or the CPU smoke run's."""

    lm: LMSizes
    lm_steps: int
    attention: tuple[int, int, int, int]  # batch, sequence, heads, head dimension
    attention_iters: int
    rows: Settings
    models: tuple[Any, ...]
    moe: Any
    moe_pairs: int
    moe_block_seconds: float


ACCELERATOR = Config(
    lm=LMSizes(layers=12, d_model=1024, heads=16, hidden=4096, vocab=32768, rows=16, length=1024),
    lm_steps=20,
    attention=(16, 1024, 16, 64), attention_iters=20,
    rows=Settings(pairs=10, block_seconds=0.1, warmup_steps=10),
    models=(SMALL, LARGE), moe=moe_dropless.ACCELERATOR, moe_pairs=6, moe_block_seconds=0.5,
)
SMOKE = Config(
    lm=LMSizes(layers=2, d_model=32, heads=4, hidden=64, vocab=64, rows=2, length=16), lm_steps=2,
    attention=(1, 32, 2, 16), attention_iters=2,
    rows=Settings(pairs=2, block_seconds=1e-3, warmup_steps=1, min_steps=2, max_steps=2,
                  use_stepper_minimums=False, calibration_blocks=1),
    models=(TINY,), moe=moe.SMOKE, moe_pairs=2, moe_block_seconds=0.02,
)


# ------------------------------------------------------------------------------------------- the LM
def attention_fn(kind: str, platform: str) -> tuple[Callable, str]:
    """``(fn(q, k, v) -> out, label)``: causal attention on ``[batch, sequence, heads, head_dim]``
    arrays.

    ``kind``: ``"jd.nn"`` (``jd.nn.dot_product_attention``) or ``"jax.nn"``
    (``jax.nn.dot_product_attention``, cuDNN on NVIDIA GPUs, XLA elsewhere).
    """
    if kind == "jd.nn":
        return functools.partial(jd.nn.dot_product_attention,
                                 causal=True), "jd.nn.dot_product_attention"
    implementation = "cudnn" if platform == "gpu" else "xla"
    fn = functools.partial(jax.nn.dot_product_attention, is_causal=True,
                           implementation=implementation)
    return fn, f'jax.nn.dot_product_attention(implementation="{implementation}")'


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a GELU MLP."""

    sizes: LMSizes
    attention: Callable
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        s = self.sizes
        h = nn.LayerNorm(dtype=self.dtype)(x)
        qkv = nn.DenseGeneral((3, s.heads, s.d_model // s.heads), dtype=self.dtype)(h)
        out = self.attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
        x = x + nn.DenseGeneral(s.d_model, axis=(-2, -1), dtype=self.dtype)(out)
        h = nn.LayerNorm(dtype=self.dtype)(x)
        h = nn.Dense(s.d_model, dtype=self.dtype)(nn.gelu(nn.Dense(s.hidden, dtype=self.dtype)(h)))
        return x + h


class GPT(nn.Module):
    """A GPT-style decoder: token and learned position embeddings, ``layers`` blocks, a tied
    head."""

    sizes: LMSizes
    attention: Callable
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        s = self.sizes
        embed = nn.Embed(s.vocab, s.d_model)
        position = self.param("position", nn.initializers.normal(0.02), (s.length, s.d_model))
        x = (embed(tokens) + position[: tokens.shape[1]]).astype(self.dtype)
        for _ in range(s.layers):
            x = Block(s, self.attention, self.dtype)(x)
        return embed.attend(nn.LayerNorm(dtype=self.dtype)(x)).astype(jnp.float32)


def _loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def analytic_flops(sizes: LMSizes, parameters: int) -> float:
    """(6 N + 12 L d T) x tokens: the model FLOPs of one training step (attention counted whole)."""
    per_token = 6 * parameters + 12 * sizes.layers * sizes.d_model * sizes.length
    return float(per_token * sizes.tokens)


def _peak_in_use(device: jax.Device) -> int | None:
    try:
        stats = device.memory_stats()
    except Exception:  # a backend without statistics may raise instead of returning None
        stats = None
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def lm_row(kind: str, config: Config, device: jax.Device, peak: float | None,
           memory: bool) -> dict[str, Any]:
    """Train the LM through the Trainer with one attention; its rates, utilisations and (``memory``)
    plan check."""
    sizes = config.lm
    attention, label = attention_fn(kind, device.platform)
    model = GPT(sizes, attention, jnp.bfloat16)
    rng = np.random.default_rng(0)
    batches = [
        (x[:, :-1], x[:, 1:])
        for x in (rng.integers(0, sizes.vocab, (sizes.rows, sizes.length + 1), dtype=np.int32)
                  for _ in range(2))
    ]
    strategy = jd.OneDeviceStrategy(device)
    trainer = jd.training.Trainer(strategy, model, optax.adamw(3e-4), _loss,
                                  tokens_per_example=sizes.length, peak_flops=peak)
    start = time.perf_counter()
    trainer.fit(batches, steps=2, verbose=0)  # compiles; the second step is warm
    jax.block_until_ready(trainer.state)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    history = trainer.fit(batches, steps=2 + config.lm_steps, log_every=config.lm_steps, verbose=0)
    jax.block_until_ready(trainer.state)
    steps_per_sec = config.lm_steps / (time.perf_counter() - start)
    cost = trainer.step_cost()
    parameters = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(trainer.params))
    analytic = analytic_flops(sizes, parameters)
    row = {
        "attention": label, "parameters": parameters, "steps_per_sec": steps_per_sec,
        "tokens_per_sec": steps_per_sec * sizes.tokens, "compile_and_2_steps_s": compile_s,
        "program_flops": cost.flops, "model_flops": cost.model_flops, "analytic_flops": analytic,
        "program_over_analytic": cost.model_flops / analytic if cost.model_flops else None,
        "uncosted": list(cost.uncosted), "loss": float(history.train[-1]["loss"]),
        "mfu_trainer": history.train[-1].get("mfu"), "hfu_trainer": history.train[-1].get("hfu"),
        "mfu_analytic": analytic * steps_per_sec / peak if peak else None,
    }
    if memory:
        plan = trainer.plan(batches[0])
        row["plan_peak_bytes"] = plan.peak_bytes
        row["peak_bytes_in_use"] = _peak_in_use(device)
    return row


# -------------------------------------------------------------------------------- attention kernels
def _attention_impls(platform: str) -> list[tuple[str, Callable | None, str]]:
    """``(label, fn or None, why not)`` of the attention kernels to time on ``platform``."""
    impls: list[tuple[str, Callable | None, str]] = [
        ("jd.nn.dot_product_attention", functools.partial(jd.nn.dot_product_attention, causal=True),
         ""),
        ('jax.nn.dot_product_attention(implementation="xla")',
         functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="xla"), ""),
    ]
    cudnn = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn")
    impls.append(('jax.nn.dot_product_attention(implementation="cudnn")', cudnn if platform == "gpu"
                  else None, "cuDNN needs an NVIDIA GPU"))
    try:
        import tokamax  # an optional extra: timed where installed
    except ImportError:
        impls.append(("tokamax.dot_product_attention", None, "tokamax is not installed"))
    else:
        impls.append(("tokamax.dot_product_attention",
                      functools.partial(tokamax.dot_product_attention, is_causal=True), ""))
    return impls


def attention_rows(config: Config, device: jax.Device) -> list[dict[str, Any]]:
    """Forward + backward TFLOP/s of each attention kernel (analytic FLOPs, and
    `program_cost`'s)."""
    b, t, h, d = config.attention
    analytic = 3 * 4 * b * h * t * t * d
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, ct = (jax.device_put(jax.random.normal(key, (b, t, h, d), jnp.bfloat16), device)
                   for key in keys)
    rows = []
    for label, fn, why in _attention_impls(device.platform):
        if fn is None:
            rows.append({"kernel": label, "skipped": why})
            continue
        try:
            def loss(q, k, v, fn=fn):
                return (fn(q, k, v).astype(jnp.float32) * ct.astype(jnp.float32)).sum()

            step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            compiled = step.lower(q, k, v).compile()
            jax.block_until_ready(compiled(q, k, v))
            times = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(config.attention_iters):
                    out = compiled(q, k, v)
                jax.block_until_ready(out)
                times.append((time.perf_counter() - start) / config.attention_iters)
            seconds = float(np.median(times))
            counted = jd.program_cost(compiled)
            rows.append({"kernel": label, "ms": seconds * 1e3,
                         "tflops_analytic": analytic / seconds / 1e12,
                         "program_flops": counted.flops,
                         "tflops_program": counted.flops / seconds / 1e12,
                         "kernels": counted.kernels, "uncosted": list(counted.uncosted)})
        except Exception as error:  # one kernel failing (a missing cuDNN) leaves the others' rows
            traceback.print_exc()
            rows.append({"kernel": label, "error": f"{type(error).__name__}: {error}",
                         # an optional extra fails the run in no case
                         "optional": label.startswith("tokamax")})
    return rows


# ---------------------------------------------------------------------------------------- the table
def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _row_line(r: Row) -> str:
    if r.ratio is None:
        return (f"| {r.key} | {r.model} | {r.candidate_label} / {r.baseline_label} | - | "
                f"{r.status}: {r.note} |")
    rate = f"{r.rate_candidate.median:,.0f} vs {r.rate_baseline.median:,.0f}"
    return (f"| {r.key} | {r.model} | {r.candidate_label} / {r.baseline_label} | "
            f"**{r.ratio.median:.3f}** [{r.ratio.ci_low:.3f}, {r.ratio.ci_high:.3f}] | {rate} "
            "steps/s |")


def markdown(result: dict[str, Any], machine: dict[str, Any], config: Config) -> str:
    """The run's table."""
    cpu = machine["backend"] == "cpu"
    lines = [f"# Accelerator run ({machine['date'][:10]}, {machine['backend']}: "
             f"{machine['device_kind']})", ""]
    if cpu:
        lines += ["**CPU: tiny sizes, a check that everything runs. The numbers below mean nothing "
                  "about an accelerator (no peak, so no MFU).**", ""]
    peak = result.get("peak_flops")
    shown = "n/a" if peak is None else jd.costs.format_flops(peak) + "/s"
    lines += [f"Peak: {shown} ({result.get('peak_source')}).", ""]
    if "rows" in result:
        lines += ["## Per-call rows (steps/s ratio, jaxdist / hand-written; median [95% CI])", "",
                  "| row | model | candidate / baseline | ratio | steps/s |",
                  "|---|---|---|---|---|"]
        lines += [_row_line(r) for r in result["rows"]]
        lines.append("")
    s = config.lm
    if "lm" in result:
        lines += [f"## LM through the Trainer ({s.layers} layers, d_model {s.d_model}, {s.heads} "
                  f"heads, MLP {s.hidden}, vocabulary {s.vocab}, {s.rows} x {s.length} tokens, "
                  "bf16 compute / f32 parameters, AdamW)", "",
                  "| attention | steps/s | tokens/s | MFU (Trainer: program_cost) | HFU (Trainer) "
                  "| MFU (6N + 12LdT) | program_cost / analytic FLOPs |",
                  "|---|---|---|---|---|---|---|"]
        for r in result["lm"]:
            if "error" in r:
                lines.append(f"| {r['attention']} | error: {r['error']} | | | | | |")
                continue
            ratio = (
                "-" if r["program_over_analytic"] is None else f"{r['program_over_analytic']:.3f}"
            )
            lines.append(f"| {r['attention']} | {r['steps_per_sec']:.2f} | "
                         f"{r['tokens_per_sec']:,.0f} | {_pct(r['mfu_trainer'])} | "
                         f"{_pct(r['hfu_trainer'])} | {_pct(r['mfu_analytic'])} | {ratio} |")
        first = result["lm"][0]
        if "plan_peak_bytes" in first:
            used = first["peak_bytes_in_use"]
            measured = (
                "n/a (the device keeps no memory statistics)" if used is None else f"{used:,}"
            )
            lines += ["", f"Plan against the device ({first['attention']}): `plan.peak_bytes` "
                      f"{first['plan_peak_bytes']:,}, `peak_bytes_in_use` {measured}."]
        lines.append("")
    if "moe" in result:
        m = result["moe"]
        if "error" in m:
            lines += ["## Dropless MoE", "", f"error: {m['error']}", ""]
        else:
            q = m["ratio"]
            lines += [f"## Dropless MoE ({m['dtype']}): ragged / padded steps/s "
                      f"**{q['median']:.3f}** [{q['ci_low']:.3f}, {q['ci_high']:.3f}]", "",
                      "| path | dispatch | tokens/s | TFLOP/s (program_cost) | MFU |",
                      "|---|---|---|---|---|"]
            for r in m["rows"]:
                lines.append(f"| {r['path']} | {', '.join(r['dispatch'])} | "
                             f"{r['tokens_per_sec']:,.0f} | {r['achieved_flops'] / 1e12:.3f} | "
                             f"{_pct(r['mfu'])} |")
            lines.append("")
    if "attention" in result:
        b, t, h, d = config.attention
        lines += [f"## Attention kernels, forward + backward ({b} x {t} x {h} heads x {d}, causal, "
                  "bf16)", "",
                  "| kernel | ms | TFLOP/s (analytic, mask not halved) | TFLOP/s (program_cost) | "
                  "counted as |",
                  "|---|---|---|---|---|"]
        for r in result["attention"]:
            if "ms" not in r:
                lines.append(f"| {r['kernel']} | {r.get('skipped') or 'error: ' + r['error']} | | "
                             "| |")
                continue
            counted = ", ".join(r["kernels"]) or "XLA's own ops"
            if r["uncosted"]:
                counted += f"; at least: {', '.join(r['uncosted'])} not costed"
            lines.append(f"| {r['kernel']} | {r['ms']:.3f} | {r['tflops_analytic']:.1f} | "
                         f"{r['tflops_program']:.1f} | {counted} |")
        lines.append("")
    return "\n".join(lines)


def run(config: Config, parts: Sequence[str], device: jax.Device) -> dict[str, Any]:
    """Run the ``parts`` of the benchmark on ``device``; a part that fails is reported, the others
    still run."""
    row = jd.costs.accelerator_of_device(device)
    result: dict[str, Any] = {"peak_flops": row.flops if row else None,
                              "peak_source": row.source if row
                              else f"no datasheet peak for {device.device_kind}"}
    peak = result["peak_flops"]
    if "rows" in parts:
        plan = [(c, spec) for spec in config.models for c in COMPARISONS if c.key in ROWS]
        result["rows"] = run_plan(plan, config.rows, Devices((device,)))
    if "lm" in parts:
        result["lm"] = []
        for i, kind in enumerate(("jd.nn", "jax.nn")):
            try:
                result["lm"].append(lm_row(kind, config, device, peak, memory=i == 0))
            except Exception as error:
                traceback.print_exc()
                result["lm"].append({"attention": attention_fn(kind, device.platform)[1],
                                     "error": f"{type(error).__name__}: {error}"})
            print(f"[lm {kind}] {result['lm'][-1]}", file=sys.stderr, flush=True)
    if "moe" in parts:
        dtype = jnp.dtype(jnp.float32 if device.platform == "cpu" else jnp.bfloat16)
        try:
            result["moe"] = moe_dropless.measure(config.moe, config.moe_pairs,
                                                 config.moe_block_seconds, dtype)
        except Exception as error:
            traceback.print_exc()
            result["moe"] = {"error": f"{type(error).__name__}: {error}"}
    if "attention" in parts:
        result["attention"] = attention_rows(config, device)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.accelerator",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS,
                        help=f"results folder (default {RESULTS})")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, seconds (what a CPU run does anyway)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated parts to run, from {PARTS}")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown part(s) {unknown}; choose from {list(PARTS)}")
    device = jax.devices()[0]
    smoke = args.smoke or device.platform == "cpu"
    config = SMOKE if smoke else ACCELERATOR
    machine = machine_info((device,))
    print(f"benchmarks.accelerator: {'smoke (tiny sizes)' if smoke else 'full'} run on "
          f"{device.device_kind}",
          file=sys.stderr, flush=True)
    result = run(config, parts, device)
    table = markdown(result, machine, config)
    data = {"machine": machine, "smoke": smoke, "config": dataclasses.asdict(config),
            **{k: ([dataclasses.asdict(r) for r in v] if k == "rows" else v)
               for k, v in result.items()}}
    stem = f"{machine['date'][:10]}-{machine['backend']}-accelerator" + ("-smoke" if smoke else "")
    write_table(args.out, stem, table, data)
    print(table)
    failed = [r for r in result.get("rows", []) if r.status == "error"]
    failed += [r for part in ("lm", "attention") for r in result.get(part, [])
               if "error" in r and not r.get("optional")]
    return 1 if failed or "error" in result.get("moe", {}) else 0


if __name__ == "__main__":
    sys.exit(main())
