"""What a compiled train step costs per device, for utilisation: `StepCost`, read from its `Plan`.

The Trainer plans its compiled train step once (``Trainer.plan``: `jaxdist.costs.program_cost` of
the partitioned program every device runs, XLA's memory analysis, the state's layout) and reads its
`StepCost` from that plan (`StepCost.of_plan`). At each log point the fit loop turns the window's
steps, seconds and tokens into

* ``hfu``: hardware FLOPs utilisation: the FLOPs the program executes per device per step
  (rematerialisation and replicated optimizer work included) x steps/s / the device's peak FLOP/s;
* ``mfu``: model FLOPs utilisation: the model's FLOPs instead, ``flops_per_step=`` / devices when
  given (e.g. 6 x parameters x tokens for a transformer), else the executed FLOPs without
  recomputation (`jaxdist.costs.ProgramCost.model_flops`).

  The peak is the dense bf16 figure of the vendor's datasheet for the accelerators in
  `jaxdist.costs.ACCELERATORS` (per chip; one JAX device is one chip on these), or the
  ``peak_flops`` the user gives (e.g. a measured one). Nothing else: on CPU, or an accelerator not
  in the table, both are "n/a", never a made-up number. A custom call the count cannot cost (named
  in `StepCost.uncosted`) makes both lower bounds, and the start line says so.
* ``tokens_per_sec``: tokens per step / step time, where tokens per step are ``tokens_per_example``
  x the global batch's rows when given (every position, padding included: what the devices process),
  else the summed weight of a token-weighted loss (the real tokens the loss averages over), else not
  logged.
* ``peak_bytes_in_use``: the most any device has held (``device.memory_stats()``), where the backend
  keeps such statistics (GPU, TPU; CPU does not).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jaxdist.costs.memory import bytes_per_device, device_memory
from jaxdist.costs.peaks import accelerator_of_device
from jaxdist.costs.plan import Plan, read_plan
from jaxdist.costs.program import _Undercount
from jaxdist.costs.units import format_bytes, format_flops

__all__ = ["CostOptions", "StepCost", "measure_step_cost"]


def _positive(value: Any, name: str, fix: str) -> None:
    if value is None:
        return
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value <= 0):
        raise ValueError(f"{name}={value!r} must be a positive number: {fix}")


@dataclasses.dataclass(frozen=True)
class CostOptions:
    """How the trainer counts tokens and FLOPs (the `Trainer` options of the same names).

    Attributes:
        tokens_per_example: tokens in one example (a language model's sequence length): tokens per
            step are this times the global batch's rows. None: the loss's summed token weight.
        peak_flops: the peak FLOP/s of ONE device, replacing the datasheet table (e.g. measured).
        flops_per_step: the model's FLOPs per optimizer step over the global batch (for ``mfu``).

    Raises:
        ValueError: for a value that is not a positive number (``tokens_per_example``: an int),
            naming the option, the value and the fix.

    Examples:
        >>> CostOptions(tokens_per_example=128).tokens_per_example
        128
        >>> try:
        ...     CostOptions(peak_flops=-1.0)
        ... except ValueError as error:
        ...     print(str(error).split(":")[0])
        peak_flops=-1.0 must be a positive number
    """

    tokens_per_example: int | None = None
    peak_flops: float | None = None
    flops_per_step: float | None = None

    def __post_init__(self) -> None:
        n = self.tokens_per_example
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(
                f"tokens_per_example={n!r} must be an int >= 1 (the tokens in one example, e.g. "
                "the sequence length) or None (count the weight a token-weighted loss returns).")
        _positive(self.peak_flops, "peak_flops", "the peak FLOP/s of ONE device (e.g. 989.4e12 for "
                  "an H100 SXM in dense bf16, or a measured peak), or None to use the datasheet "
                  "table (MFU n/a where unknown).")
        _positive(self.flops_per_step, "flops_per_step", "the model's FLOPs per optimizer step "
                  "over the global batch (e.g. 6 * parameters * tokens per step), or None to count "
                  "the compiled step's FLOPs without recomputation.")


@dataclasses.dataclass(frozen=True)
class StepCost(_Undercount):
    """What one compiled training step costs, per device (``Trainer.step_cost()``; the start line of
    ``fit``): a view of the train step's `Plan` for utilisation.

    Its counts are the plan's, under the plan's names (``param_bytes`` is
    ``plan.state_bytes["params"]``, and so on); it adds what a plan cannot know: the devices' peak
    FLOP/s, the tokens a step processes and the devices to ask for live memory.

    Attributes:
        flops: FLOPs each device executes per optimizer step (`jaxdist.costs.program_cost`: the
            basis of HFU), or None when not counted.
        flops_source: where ``flops`` comes from.
        peak_flops: peak FLOP/s of one device, or None when unknown (CPU; HFU and MFU are "n/a").
        peak_source: where ``peak_flops`` comes from, or why it is unknown.
        param_bytes / optimizer_bytes / model_state_bytes: bytes each device holds (its shards).
        temp_bytes: the step's temporaries per device (XLA's memory analysis), None when not given.
        device_kind: the devices' ``device_kind``; num_devices: how many run the step.
        tokens_per_step: tokens per step when fixed (``tokens_per_example`` x rows); None: counted
            per step from a token-weighted loss's weight, or not at all.
        unknown_loops: loops in the step whose trip count XLA did not record (counted once:
            ``flops`` is then a lower bound).
        devices: this process's devices (for ``device.memory_stats()``).
        model_flops: the model's FLOPs per device per step (the basis of MFU): ``flops_per_step=`` /
            devices, else ``flops`` without recomputation; None when not known.
        model_flops_source: where ``model_flops`` comes from.
        uncosted: custom calls the count could not cost (counted as 0): while any is named,
            ``flops`` and the utilisations are lower bounds.
        plan: the train step's `Plan` these figures were read from (None for a hand-built cost, or
            when the step could not be planned: ``flops_source`` says why).

    Examples:
        >>> cost = StepCost(flops=2e12, flops_source="program_cost", peak_flops=1e15,
        ...                 peak_source="given", param_bytes=4, optimizer_bytes=8,
        ...                 model_state_bytes=0, temp_bytes=16, device_kind="cpu", num_devices=1,
        ...                 model_flops=1.5e12)
        >>> cost.hfu(steps_per_sec=100.0), cost.mfu(steps_per_sec=100.0)
        (0.2, 0.15)
    """

    flops: float | None
    flops_source: str
    peak_flops: float | None
    peak_source: str
    param_bytes: int
    optimizer_bytes: int
    model_state_bytes: int
    temp_bytes: int | None
    device_kind: str
    num_devices: int
    tokens_per_step: float | None = None
    unknown_loops: int = 0
    devices: tuple = dataclasses.field(default=(), repr=False, compare=False)
    model_flops: float | None = None
    model_flops_source: str = ""
    uncosted: tuple[str, ...] = ()
    plan: Plan | None = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def of_plan(cls, plan: Plan | None, *, options: CostOptions, devices: Sequence[Any],
                local_devices: Sequence[Any], rows_per_step: int,
                state_bytes: Mapping[str, int] | None = None, why: str = "") -> StepCost:
        """The cost of a train step read from its `Plan`, with the peak and tokens of ``options``.

        Args:
            plan: the train step's plan (``Trainer.plan``: its state argument's parts name the roles
                ``params``, ``opt_state`` and ``model_state``); None when it could not be planned.
            options: the `CostOptions`.
            devices: every device the step runs on; local_devices: this process's.
            rows_per_step: the global batch's rows.
            state_bytes: the roles' bytes per device when ``plan`` is None (`bytes_per_device`).
            why: why ``plan`` is None (shown as the FLOPs' source).

        Returns:
            The `StepCost`.

        Examples:
            >>> import jax, jax.numpy as jnp
            >>> from jaxdist.costs.plan import read_plan
            >>> compiled = jax.jit(lambda w, x: x @ w).lower(jnp.ones((4, 2)), jnp.ones((8, 4)))
            >>> plan = read_plan(compiled.compile(), state_bytes={"params": 32, "batch": 128})
            >>> cost = StepCost.of_plan(plan, options=CostOptions(peak_flops=1e9), rows_per_step=8,
            ...                         devices=jax.devices()[:1], local_devices=jax.devices()[:1])
            >>> cost.flops, cost.model_flops, cost.param_bytes, cost.hfu(1000.0), cost.plan is plan
            (128.0, 128.0, 32, 0.000128, True)
        """
        kind = devices[0].device_kind
        if options.peak_flops is not None:
            peak, peak_source = float(options.peak_flops), "peak_flops="
        else:
            row = accelerator_of_device(kind)
            peak, peak_source = ((row.flops, row.source) if row is not None
                                 else (None, f"no datasheet peak for {kind}"))
        if options.flops_per_step is not None:
            model, model_source = options.flops_per_step / len(devices), "flops_per_step= / devices"
        elif plan is not None:
            model, model_source = plan.model_flops, "program_cost without recomputation"
        else:
            model, model_source = None, "n/a"
        roles = plan.state_bytes if plan is not None else (state_bytes or {})
        tokens = (None if options.tokens_per_example is None
                  else float(options.tokens_per_example * rows_per_step))
        return cls(
            flops=None if plan is None else plan.flops,
            flops_source="program_cost" if plan is not None else f"n/a{f' ({why})' if why else ''}",
            peak_flops=peak, peak_source=peak_source, param_bytes=roles.get("params", 0),
            optimizer_bytes=roles.get("opt_state", 0),
            model_state_bytes=roles.get("model_state", 0),
            temp_bytes=None if plan is None else plan.temp_bytes, device_kind=kind,
            num_devices=len(devices), tokens_per_step=tokens,
            unknown_loops=0 if plan is None else plan.unknown_loops, devices=tuple(local_devices),
            model_flops=model, model_flops_source=model_source,
            uncosted=() if plan is None else plan.uncosted, plan=plan)

    def hfu(self, steps_per_sec: float) -> float | None:
        """Hardware FLOPs utilisation: ``flops * steps_per_sec / peak_flops`` (None: n/a)."""
        if self.flops is None or self.peak_flops is None:
            return None
        return self.flops * steps_per_sec / self.peak_flops

    def mfu(self, steps_per_sec: float) -> float | None:
        """Model FLOPs utilisation at ``steps_per_sec``: ``model_flops * steps_per_sec /
        peak_flops`` (None: n/a)."""
        if self.model_flops is None or self.peak_flops is None:
            return None
        return self.model_flops * steps_per_sec / self.peak_flops

    def rates(self, steps: int, seconds: float, loss_weight: float | None) -> dict[str, float]:
        """A log window's ``tokens_per_sec``, ``mfu``, ``hfu`` and ``peak_bytes_in_use`` (if known).

        Args:
            steps: the window's steps; seconds: how long they took.
            loss_weight: the window's summed token-weighted loss weight, or None.

        Examples:
            >>> cost = StepCost(flops=2e12, flops_source="program_cost", peak_flops=1e15,
            ...                 peak_source="given", param_bytes=0, optimizer_bytes=0,
            ...                 model_state_bytes=0, temp_bytes=None, device_kind="cpu",
            ...                 num_devices=1, tokens_per_step=512.0, model_flops=1e12)
            >>> cost.rates(10, 0.5, None)
            {'tokens_per_sec': 10240.0, 'mfu': 0.02, 'hfu': 0.04}
        """
        out: dict[str, float] = {}
        if not seconds > 0:
            return out
        tokens = steps * self.tokens_per_step if self.tokens_per_step is not None else loss_weight
        if tokens is not None:
            out["tokens_per_sec"] = tokens / seconds
        for key, value in (("mfu", self.mfu(steps / seconds)), ("hfu", self.hfu(steps / seconds))):
            if value is not None:
                out[key] = value
        live = device_memory(self.devices)
        if live and "peak_bytes_in_use" in live:
            out["peak_bytes_in_use"] = float(live["peak_bytes_in_use"])
        return out

    def summary(self) -> str:
        """The short line ``fit`` shows at its start: FLOPs and bytes per device (`describe` has
        every detail). The peak FLOP/s shows only where it is known (MFU and HFU are logged then);
        "at least" marks FLOPs that are a lower bound (`lower_bound`).

        Examples:
            >>> StepCost(flops=1.5e9, flops_source="program_cost", peak_flops=None,
            ...          peak_source="cpu", param_bytes=2048, optimizer_bytes=4096,
            ...          model_state_bytes=0, temp_bytes=1024, device_kind="cpu",
            ...          num_devices=8).summary()
            'per device: 1.5 GFLOP/step, params 2 KiB, optimizer 4 KiB, temp 1 KiB'
        """
        if self.flops is None:
            parts = ["FLOPs not counted"]
        else:
            parts = [f"{'at least ' if self.lower_bound else ''}{format_flops(self.flops)}/step"]
        parts += [f"params {format_bytes(self.param_bytes)}",
                  f"optimizer {format_bytes(self.optimizer_bytes)}"]
        if self.model_state_bytes:
            parts.append(f"model state {format_bytes(self.model_state_bytes)}")
        if self.temp_bytes is not None:
            parts.append(f"temp {format_bytes(self.temp_bytes)}")
        if self.peak_flops is not None:
            parts.append(f"peak {format_flops(self.peak_flops)}/s")
        return "per device: " + ", ".join(parts)

    def describe(self) -> str:
        """The one line ``fit`` logs at its start with ``verbose=2`` (`summary` is the short one).

        Examples:
            >>> line = StepCost(flops=1.5e9, flops_source="program_cost", peak_flops=None,
            ...                 peak_source="no datasheet peak for cpu", param_bytes=2048,
            ...                 optimizer_bytes=4096, model_state_bytes=0, temp_bytes=1024,
            ...                 device_kind="cpu", num_devices=8, model_flops=1.5e9,
            ...                 model_flops_source="program_cost without recomputation",
            ...                 uncosted=("my_kernel (jit(step)/my_kernel)",)).describe()
            >>> print(line.replace("; ", ";\\n").replace(", model", ",\\nmodel"))
            train step per device (8 devices): 1.5 GFLOP executed (program_cost),
            model 1.5 GFLOP (program_cost without recomputation);
            at least: 1 custom call(s) not costed: my_kernel (jit(step)/my_kernel);
            params 2 KiB, optimizer state 4 KiB, temporaries 1 KiB;
            peak n/a (no datasheet peak for cpu: MFU and HFU n/a, pass Trainer(peak_flops=...));
            live memory n/a
        """
        flops = ("FLOPs n/a" if self.flops is None
                 else f"{format_flops(self.flops)} executed ({self.flops_source})")
        if self.model_flops is not None:
            flops += f", model {format_flops(self.model_flops)} ({self.model_flops_source})"
        if self.uncosted:
            flops += (f"; at least: {len(self.uncosted)} custom call(s) not costed: "
                      f"{', '.join(self.uncosted[:4])}"
                      + (", ..." if len(self.uncosted) > 4 else ""))
        if self.unknown_loops:
            flops += f"; at least: {self.unknown_loops} loop(s) of unknown trip count counted once"
        memory = (f"params {format_bytes(self.param_bytes)}, "
                  f"optimizer state {format_bytes(self.optimizer_bytes)}")
        if self.model_state_bytes:
            memory += f", model state {format_bytes(self.model_state_bytes)}"
        temp = "n/a" if self.temp_bytes is None else format_bytes(self.temp_bytes)
        memory += f", temporaries {temp}"
        if self.peak_flops is None:
            peak = f"peak n/a ({self.peak_source}: MFU and HFU n/a, pass Trainer(peak_flops=...))"
        else:
            peak = f"peak {format_flops(self.peak_flops)}/s ({self.peak_source})"
        live = device_memory(self.devices)
        live_text = "live memory " + (", ".join(
            f"{format_bytes(live[k])} {label}" for k, label in (
                ("bytes_in_use", "in use"), ("peak_bytes_in_use", "peak"), ("bytes_limit", "limit"))
            if k in live) if live else "n/a")
        return (f"train step per device ({self.num_devices} devices): {flops}; {memory}; {peak}; "
                f"{live_text}")


def measure_step_cost(compiled: Any, state: Any, *, devices: Sequence[Any],
                      local_devices: Sequence[Any], options: CostOptions,
                      rows_per_step: int) -> StepCost:
    """The `StepCost` of a compiled train step that was not planned through a strategy: its `Plan`
    read from the compiled program (`jaxdist.costs.plan.read_plan`), the roles' bytes from
    ``state``'s layout.

    Args:
        compiled: the compiled step (``jitted.lower(...).compile()``: one optimizer step).
        state: the `TrainState` (arrays or abstract arrays with shardings): its ``params``,
            ``opt_state`` and ``model_state`` are counted (`bytes_per_device`).
        devices: every device the step runs on; local_devices: this process's.
        options: the `CostOptions`.
        rows_per_step: the global batch's rows.

    Returns:
        The `StepCost` (FLOPs n/a, not a failure, on a backend that gives no program text).

    Examples:
        >>> import jax, jax.numpy as jnp, jaxdist as jd
        >>> compiled = jax.jit(lambda w, x: x @ w).lower(jnp.ones((4, 2)), jnp.ones((8, 4)))
        >>> state = jd.training.TrainState(0, {"w": jnp.ones((4, 2))}, (), {}, None)
        >>> cost = measure_step_cost(compiled.compile(), state, devices=jax.devices()[:1],
        ...                          local_devices=jax.devices()[:1],
        ...                          options=CostOptions(peak_flops=1e9), rows_per_step=8)
        >>> cost.flops, cost.model_flops, cost.param_bytes, cost.hfu(1000.0)
        (128.0, 128.0, 32, 0.000128)
    """
    roles = {k: bytes_per_device(getattr(state, k)) for k in ("params", "opt_state", "model_state")}
    try:
        plan = read_plan(compiled, state_bytes=roles)
    except Exception as error:  # a backend without module text or memory analysis: not a failure
        return StepCost.of_plan(None, options=options, devices=devices, local_devices=local_devices,
                                rows_per_step=rows_per_step, state_bytes=roles,
                                why=type(error).__name__)
    return StepCost.of_plan(plan, options=options, devices=devices, local_devices=local_devices,
                            rows_per_step=rows_per_step)
