"""Head-to-head timing: two steppers measured in alternating blocks, one ratio per pair of blocks.

Both sides of a comparison run in the same process, interleaved, so that slow drift (another process
starting, thermal or frequency changes) hits both alike and cancels in the per-pair ratio:

1. warm-up: each stepper runs its warm-up blocks (the first call compiles), and the fastest later
   warm-up block (``calibration_blocks`` of them) gives its seconds per step;
2. the block length is chosen from those estimates so that the slower side's block lasts about
   ``block_seconds`` (a multiple of both steppers' ``step_multiple``, and at least both steppers'
   ``min_block_steps`` and ``min_block_seconds``: see `Stepper`);
3. ``pairs`` pairs of blocks run in alternating order (A B, B A, A B, ...: each side goes first
   equally often), each block ending with ``jax.block_until_ready`` on the stepper's state;
4. each pair gives ``ratio = steps/s(A) / steps/s(B)``; the result keeps every block's time and
   reports the median ratio with its min, max, interquartile range and 95% confidence interval.

Many short pairs beat a few long ones here: with 8 simulated devices sharing 2 cores, a block's
steps/s varies by 10-20% from block to block; adjacent short blocks see the same conditions, and the
median over many pairs is stable to about ±2-4% (measured: an A/A comparison of two identical
steppers, the suite's ``null`` row).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Sequence
from typing import Protocol

__all__ = ["Settings", "Spread", "Stepper", "PairResult", "calibrate", "measure_pair", "spread"]


class Stepper(Protocol):
    """One way of running training steps; it keeps its own state between blocks."""

    step_multiple: int
    """Blocks are a multiple of this many steps (e.g. Keras ``steps_per_execution``)."""

    min_block_steps: int
    """The shortest block, in steps, that shows this stepper's steady state: a prefetching stepper
    gets a head start (its queue fills while the other side runs); blocks of several queue lengths
    dilute it."""

    min_block_seconds: float
    """The shortest block, in seconds: a ``fit``-style stepper pays a fixed setup per call (one call
    per block), which longer blocks dilute as one long ``fit`` call does in real use."""

    def run(self, steps: int) -> None:
        """Run ``steps`` training steps and return once their results are ready on the devices."""

    def close(self) -> None:
        """Release threads and buffers."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """How long to measure.

    Attributes:
        pairs: pairs of blocks per comparison (each gives one ratio).
        block_seconds: the slower side's block lasts about this long.
        warmup_steps: steps in each of the two warm-up blocks (rounded up to ``step_multiple``).
        min_steps: the shortest block, whatever the estimate.
        max_steps: the longest block (the steppers' minimums win over it).
        use_stepper_minimums: honour the steppers' ``min_block_steps`` / ``min_block_seconds`` (off
            for smoke runs only).
        calibration_blocks: timed warm-up blocks after the compiling one; the fastest gives the
            seconds per step that size the blocks (1 for smoke runs, whose block lengths are
            fixed by ``min_steps == max_steps``).
    """

    pairs: int = 30
    block_seconds: float = 0.1
    warmup_steps: int = 10
    min_steps: int = 5
    max_steps: int = 4000
    use_stepper_minimums: bool = True
    calibration_blocks: int = 3

    def __post_init__(self) -> None:
        if self.pairs < 1:
            raise ValueError(f"pairs={self.pairs} must be >= 1: each pair of blocks gives one "
                             "ratio.")
        if self.block_seconds <= 0:
            raise ValueError(f"block_seconds={self.block_seconds} must be > 0.")
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"need 1 <= min_steps={self.min_steps} <= max_steps={self.max_steps}.")
        if self.calibration_blocks < 1:
            raise ValueError(f"calibration_blocks={self.calibration_blocks} must be >= 1: the "
                             "fastest timed warm-up block is the estimate.")


@dataclasses.dataclass(frozen=True)
class Spread:
    """Summary of a sample: median, extremes, quartiles and a 95% confidence interval of the median.

    The interval is distribution-free (order statistics of a binomial(n, 1/2) count), so it needs no
    assumption about the shape of the noise; with fewer than 6 values it is simply [min, max].
    """

    median: float
    min: float
    max: float
    q1: float
    q3: float
    ci_low: float
    ci_high: float
    n: int


def spread(values: Sequence[float]) -> Spread:
    """Median, min, max, quartiles (linear interpolation) and the median's 95% confidence interval.

    Example:
        >>> spread([1.0, 2.0, 3.0, 4.0]).median
        2.5
    """
    if not values:
        raise ValueError("spread() needs at least one value.")
    ordered = sorted(values)
    n = len(ordered)
    if n == 1:
        q1 = q3 = ordered[0]
    else:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    # normal approximation of the binomial order statistic
    k = math.floor((n - 1.96 * math.sqrt(n)) / 2)
    low, high = (ordered[k], ordered[n - 1 - k]) if k >= 0 else (ordered[0], ordered[-1])
    return Spread(statistics.median(ordered), ordered[0], ordered[-1], q1, q3, low, high, n)


def _round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def _timed(stepper: Stepper, steps: int) -> float:
    start = time.perf_counter()
    stepper.run(steps)
    return time.perf_counter() - start


@contextlib.contextmanager
def _gc_paused():
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def calibrate(stepper: Stepper, settings: Settings) -> float:
    """Warm ``stepper`` up (compiling on its first call) and return its seconds per step.

    One warm-up block compiles; of the next ``settings.calibration_blocks`` (3 unless set), the
    fastest is the estimate (a burst of other activity on the machine only ever slows a block down).
    """
    steps = _round_up(settings.warmup_steps, stepper.step_multiple)
    _timed(stepper, steps)
    with _gc_paused():
        return min(_timed(stepper, steps) for _ in range(settings.calibration_blocks)) / steps


@dataclasses.dataclass
class PairResult:
    """Every block time of one A-versus-B measurement.

    Attributes:
        steps: steps per block (both sides).
        seconds_a: block times of A, one per pair.
        seconds_b: block times of B, one per pair.
        a_first: per pair, whether A's block ran first.
    """

    steps: int
    seconds_a: list[float]
    seconds_b: list[float]
    a_first: list[bool]

    @property
    def rates_a(self) -> list[float]:
        """A's steps per second, one per block."""
        return [self.steps / s for s in self.seconds_a]

    @property
    def rates_b(self) -> list[float]:
        """B's steps per second, one per block."""
        return [self.steps / s for s in self.seconds_b]

    @property
    def ratios(self) -> list[float]:
        """steps/s(A) / steps/s(B) per pair (> 1: A is faster)."""
        return [b / a for a, b in zip(self.seconds_a, self.seconds_b, strict=True)]


def measure_pair(
    a: Stepper, b: Stepper, settings: Settings, per_step: tuple[float, float]
) -> PairResult:
    """Time ``a`` against ``b`` in alternating blocks (both already warmed up by `calibrate`).

    Args:
        a: the candidate.
        b: the baseline.
        settings: pairs and block length.
        per_step: seconds per step of ``a`` and ``b`` from `calibrate`, to size the blocks.

    Returns:
        The `PairResult` with every block's time.
    """
    multiple = math.lcm(a.step_multiple, b.step_multiple)
    slower = max(per_step)
    steps = round(settings.block_seconds / slower) if slower > 0 else settings.max_steps
    steps = min(max(steps, settings.min_steps), settings.max_steps)
    if settings.use_stepper_minimums:
        # The faster side's estimate: a fit-style stepper's own warm-up blocks include its per-call
        # setup.
        fastest = min(per_step)
        by_time = math.ceil(max(a.min_block_seconds,
                                b.min_block_seconds) / fastest) if fastest > 0 else 1
        steps = max(steps, a.min_block_steps, b.min_block_steps, by_time)
    steps = _round_up(steps, multiple)
    seconds_a, seconds_b, a_first = [], [], []
    for i in range(settings.pairs):
        first = i % 2 == 0
        with _gc_paused():
            if first:
                ta = _timed(a, steps)
                tb = _timed(b, steps)
            else:
                tb = _timed(b, steps)
                ta = _timed(a, steps)
        seconds_a.append(ta)
        seconds_b.append(tb)
        a_first.append(first)
    return PairResult(steps, seconds_a, seconds_b, a_first)
