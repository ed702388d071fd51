"""Runs a plan of comparisons and collects one `Row` per (comparison, model).

Steppers are built once per model and shared by the rows that use them (so each compiles once), then
closed before the next model. A stepper that is unavailable makes its rows "skipped"; an exception
while building or timing makes the row "error" and the suite goes on.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import traceback
from collections.abc import Callable, Sequence

from benchmarks.cases import STEPPERS, Comparison, Devices
from benchmarks.models import ModelSpec, make_problem
from benchmarks.runners import Unavailable
from benchmarks.timing import Settings, Spread, Stepper, calibrate, measure_pair, spread

__all__ = ["Row", "run_plan", "stepper_rates"]


@dataclasses.dataclass
class Row:
    """The outcome of one comparison on one model (every figure goes into the JSON).

    ``status`` is "pass" / "below target (within noise)" / "below target" (rows with a target, see
    `_status`), "info" (no target), "skipped" or "error"; ``note`` says why for the last two.
    """

    key: str
    title: str
    model: str
    layers: str
    batch: int
    candidate: str
    candidate_label: str
    baseline: str
    baseline_label: str
    target: float | None
    status: str = "info"
    note: str = ""
    steps_per_block: int = 0
    seconds_candidate: list[float] = dataclasses.field(default_factory=list)
    seconds_baseline: list[float] = dataclasses.field(default_factory=list)
    candidate_first: list[bool] = dataclasses.field(default_factory=list)
    ratios: list[float] = dataclasses.field(default_factory=list)
    ratio: Spread | None = None
    rate_candidate: Spread | None = None
    rate_baseline: Spread | None = None
    wall_seconds: float = 0.0

    @property
    def measured(self) -> bool:
        """Whether the row has timings."""
        return self.ratio is not None


def _new_row(comparison: Comparison, spec: ModelSpec) -> Row:
    return Row(
        key=comparison.key,
        title=comparison.title,
        model=spec.name,
        layers=spec.layers,
        batch=spec.batch,
        candidate=comparison.candidate,
        candidate_label=STEPPERS[comparison.candidate].label,
        baseline=comparison.baseline,
        baseline_label=STEPPERS[comparison.baseline].label,
        target=comparison.target,
    )


class _Steppers:
    """Builds each stepper of one model on first use; remembers the ones that are unavailable."""

    def __init__(self, spec: ModelSpec, devices: Devices):
        self._problem = make_problem(spec)
        self._devices = devices
        self._built: dict[str, Stepper | Exception] = {}

    def get(self, key: str) -> Stepper:
        if key not in self._built:
            try:
                self._built[key] = STEPPERS[key].build(self._problem, self._devices)
            except Exception as error:  # remembered so that later rows skip or fail the same way
                self._built[key] = error
        built = self._built[key]
        if isinstance(built, Exception):
            raise built
        return built

    def close(self) -> None:
        for built in self._built.values():
            if not isinstance(built, Exception):
                built.close()
        self._built.clear()


def _measure(row: Row, steppers: _Steppers, settings: Settings) -> None:
    """Calibrate both sides, time them in alternating blocks, fill ``row`` in."""
    candidate = steppers.get(row.candidate)
    baseline = steppers.get(row.baseline)
    per_step = (calibrate(candidate, settings), calibrate(baseline, settings))
    result = measure_pair(candidate, baseline, settings, per_step)
    row.steps_per_block = result.steps
    row.seconds_candidate = result.seconds_a
    row.seconds_baseline = result.seconds_b
    row.candidate_first = result.a_first
    row.ratios = result.ratios
    row.ratio = spread(result.ratios)
    row.rate_candidate = spread(result.rates_a)
    row.rate_baseline = spread(result.rates_b)
    row.status = _status(row.ratio, row.target)


def _status(ratio: Spread, target: float | None) -> str:
    """"pass" when the median ratio meets the target; below it, whether the shortfall is beyond the
    noise.

    "below target (within noise)": the median's 95% confidence interval still reaches the target, so
    this run cannot tell the two apart; "below target": the whole interval lies under the target.
    """
    if target is None:
        return "info"
    if ratio.median >= target:
        return "pass"
    return "below target (within noise)" if ratio.ci_high >= target else "below target"


def run_plan(
    plan: Sequence[tuple[Comparison, ModelSpec]],
    settings: Settings,
    devices: Devices,
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True),
) -> list[Row]:
    """Measure every (comparison, model) of ``plan``, grouped by model, in plan order within a
    model.

    Returns:
        One `Row` per entry of ``plan``, in plan order.
    """
    rows: dict[int, Row] = {}
    models: list[ModelSpec] = []
    for _, spec in plan:
        if spec not in models:
            models.append(spec)
    for spec in models:
        steppers = _Steppers(spec, devices)
        try:
            for index, (comparison, row_spec) in enumerate(plan):
                if row_spec != spec:
                    continue
                row = rows[index] = _new_row(comparison, spec)
                start = time.perf_counter()
                row_settings = dataclasses.replace(settings,
                                                   pairs=settings.pairs * comparison.pairs_factor)
                try:
                    _measure(row, steppers, row_settings)
                except Unavailable as why:
                    row.status, row.note = "skipped", str(why)
                except Exception as error:
                    row.status, row.note = "error", f"{type(error).__name__}: {error}"
                    log(traceback.format_exc())
                row.wall_seconds = time.perf_counter() - start
                log(_progress(row))
        finally:
            steppers.close()
    return [rows[i] for i in range(len(plan))]


def _progress(row: Row) -> str:
    head = f"[{row.key} {row.model}] "
    if not row.measured:
        return head + f"{row.status}: {row.note}"
    r = row.ratio
    return (
        head + f"ratio {r.median:.3f} (95% CI {r.ci_low:.3f}-{r.ci_high:.3f}, IQR "
               f"{r.q1:.3f}-{r.q3:.3f}) "
        f"{row.rate_candidate.median:.1f} vs {row.rate_baseline.median:.1f} steps/s, "
        f"{row.steps_per_block} steps/block, {row.wall_seconds:.1f} s, {row.status}"
    )


def stepper_rates(rows: Sequence[Row]) -> dict[tuple[str, str], tuple[str, list[float]]]:
    """Every measured block's steps/s over all rows, per (model layers, stepper key): ``(label,
    rates)``."""
    rates: dict[tuple[str, str], tuple[str, list[float]]] = {}
    for row in rows:
        if not row.measured:
            continue
        for key, label, seconds in (
            (row.candidate, row.candidate_label, row.seconds_candidate),
            (row.baseline, row.baseline_label, row.seconds_baseline),
        ):
            rates.setdefault((row.layers, key), (label, []))[1].extend(
                row.steps_per_block / s for s in seconds
            )
    return rates
