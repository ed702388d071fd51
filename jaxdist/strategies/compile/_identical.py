"""Which values of a replica function are the same on every replica: a proof from its jaxpr, failing
closed.

JAX's varying types answer a coarser question, and fail open where this one must not: inside
``strategy.run`` everything computed from a mirrored argument is varying by type (it enters cast to
*varying*: `jaxdist.strategies.compile._run`), so the types cannot tell ``params - lr *
all_reduce(grads)`` (the same on every replica) from ``params - lr * grads`` with local gradients
(every replica's copy drifts apart, silently); and a primitive JAX's typing does not know (an FFI
call) types its result invariant whatever its inputs. So `program_values` follows *values*: for each
value, the set of replica axes over which it may differ (empty: proven the same on every replica).
The rules, one per kind of primitive:

* a primitive in `PURE` (arithmetic, shapes, reductions, products, sorting, linear algebra, random
  bits from a key, ``pure_callback``: a function of its operands alone, as JAX itself assumes)
  differs where one of its operands does;
* a collective over axes ``A``: ``psum`` / ``pmax`` / ``pmin`` / ``all_gather`` (`REDUCING`) no
  longer differ over ``A``; ``ppermute`` / ``all_to_all`` / ``psum_scatter`` (`SPREADING`) differ
  over ``A`` too; device groups (``axis_index_groups``) differ over ``A``; ``axis_index`` differs
  over ``A``, within known bounds;
* ``jit`` / ``remat`` / ``custom_jvp`` / ``custom_vjp`` / ``shard_map`` (`CALLS`), ``cond``,
  ``scan`` and ``while`` are read through (a loop to a fixed point; a loop whose trip count may
  differ differs);
* ANY other primitive (unknown, an FFI call, ``io_callback``, ``rng_uniform``) differs over every
  replica axis, and so does a value the reading never saw: what is not proven is not identical.

Integer bounds widen the proof where the values are known: ``replica_id >= 0`` is true on every
replica, and so a constant; ``where(replica_id >= 0, update, 0)`` is the update. The proof is
checked on device at the first call of each program (`jaxdist.strategies.compile._run`).

`updated_inputs` answers a second question: which mirrored argument an output takes the place of
(reached from it element-wise, outside the backward pass: ``params - lr * grads`` does, the gradient
does not).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from jaxdist.replicate.collectives import PER_REPLICA_SCOPE
from jaxdist.strategies.layout import Role

__all__ = ["CALLS", "DECLARED", "DIFFERENT", "IDENTICAL", "PURE", "REDUCING", "SPREADING",
           "check_mirrored_outputs", "output_values", "program_values", "updated_inputs"]

PURE = frozenset({
    # element-wise arithmetic and comparisons
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh",
    "bessel_i0e", "bessel_i1e", "cbrt", "ceil", "clamp", "clz", "complex", "conj", "cos", "cosh",
    "digamma", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt",
    "igamma", "igamma_grad_a", "igammac", "imag", "integer_pow", "is_finite", "le", "lgamma", "log",
    "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not",
    "one_minus_square", "or", "polygamma", "population_count", "pow", "real", "reduce_precision",
    "regularized_incomplete_beta", "rem", "round", "rsqrt", "select_n", "shift_left",
    "shift_right_arithmetic", "shift_right_logical", "sign", "sin", "sinh", "sqrt", "square", "sub",
    "tan", "tanh", "xor", "zeta", "mulhi",
    # shapes, types, indexing, placement (the values stay what they are)
    "bitcast_convert_type", "broadcast_in_dim", "concatenate", "convert_element_type", "copy",
    "dynamic_slice", "dynamic_update_slice", "gather", "iota", "pad", "reshape", "rev", "slice",
    "split", "squeeze", "transpose", "stack", "unstack", "tile", "zeros_like", "stop_gradient",
    "reciprocal", "log2", "scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min",
    "scatter-max", "device_put", "sharding_constraint", "reshard", "pvary", "optimization_barrier",
    # reductions, scans, products, sorting
    "argmax", "argmin", "reduce_and", "reduce_max", "reduce_min", "reduce_or", "reduce_prod",
    "reduce_sum", "reduce_xor", "reduce", "reduce_window", "reduce_window_max", "reduce_window_min",
    "reduce_window_sum", "select_and_gather_add", "select_and_scatter_add", "cumsum", "cumprod",
    "cummax", "cummin", "cumlogsumexp", "dot_general", "conv_general_dilated", "sort", "top_k",
    # linear algebra, FFT
    "cholesky", "eigh", "lu", "lu_pivots_to_permutation", "qr", "householder_product", "geqrf",
    "svd", "triangular_solve", "tridiagonal_solve", "fft",
    # random bits: functions of the key
    "random_bits", "random_fold_in", "random_seed", "random_split", "random_unwrap", "random_wrap",
    "threefry2x32", "rng_bit_generator", "random_gamma", "random_clone",
    # a host function JAX itself treats as pure (same operands, same result)
    "pure_callback",
})
"""Primitives whose results are functions of their operands alone (identical in, identical out)."""

REDUCING = frozenset({"psum", "pmax", "pmin", "psum_invariant", "all_gather",
                      "all_gather_invariant"})
"""Collectives whose result is the same on every device of the axes they span."""

SPREADING = frozenset({"ppermute", "all_to_all", "reduce_scatter", "ragged_all_to_all",
                       "pbroadcast"})
"""Collectives whose result may differ over the axes they span (each device gets its own part)."""

CALLS = frozenset({"jit", "remat2", "custom_jvp_call", "custom_vjp_call", "shard_map",
                   "compute_on"})
"""Higher-order primitives that call their inner jaxpr on their operands, one for one."""

IDENTICAL, DIFFERENT, DECLARED = "identical", "different", "declared"
"""What `program_values` says of a value: the same on every replica (proven), possibly different, or
declared different on purpose (`jaxdist.replicate.collectives.keep_per_replica`)."""

_RESHAPING = frozenset({"broadcast_in_dim", "reshape", "squeeze", "convert_element_type", "copy",
                        "pvary"})
_ONE_FOR_ONE = frozenset({"optimization_barrier", "device_put"})  # each output is its own operand
_COMPARE = {
    "ge": lambda a, b: (a[0] >= b[1], a[1] < b[0]),
    "gt": lambda a, b: (a[0] > b[1], a[1] <= b[0]),
    "le": lambda a, b: (a[1] <= b[0], a[0] > b[1]),
    "lt": lambda a, b: (a[1] < b[0], a[0] >= b[1]),
    "eq": lambda a, b: (a[0] == a[1] == b[0] == b[1], a[1] < b[0] or b[1] < a[0]),
    "ne": lambda a, b: (a[1] < b[0] or b[1] < a[0], a[0] == a[1] == b[0] == b[1]),
}


@dataclasses.dataclass(frozen=True)
class _Fact:
    """What the reading knows of one value: the replica axes over which it may differ, whether it
    was declared per replica on purpose, and its integer bounds where known (the same bounds on
    every replica)."""

    axes: frozenset[str]
    declared: bool = False
    bounds: tuple[int, int] | None = None


_SAME = _Fact(frozenset())


class _Reader:
    def __init__(self, sizes: Mapping[str, int | None]):
        self.sizes = dict(sizes)
        self.every = _Fact(frozenset(sizes))
        # collectives inside loops whose trip count may differ between replicas
        self.stalls: list[str] = []

    def replica(self, names: Any) -> frozenset[str]:
        names = (names,) if isinstance(names, str) else tuple(names or ())
        return frozenset(a for a in names if a in self.sizes)

    def literal(self, v: Any) -> _Fact:
        value = np.asarray(v.val)
        if value.ndim == 0 and (value.dtype.kind in "iub"):
            return _Fact(frozenset(), bounds=(int(value), int(value)))
        return _SAME

    def read(self, jaxpr: Any, inputs: Sequence[_Fact]) -> list[_Fact]:
        jaxpr = _open(jaxpr)
        if len(jaxpr.invars) != len(inputs):  # a form not known: nothing is proven
            return [self.every] * len(jaxpr.outvars)
        # closed-over constants: one value
        known: dict[Any, _Fact] = {v: _SAME for v in jaxpr.constvars}
        known.update(zip(jaxpr.invars, inputs, strict=True))

        def get(v: Any) -> _Fact:
            return self.literal(v) if isinstance(v, jcore.Literal) else known.get(v, self.every)

        for eqn in jaxpr.eqns:
            outs = self.equation(eqn, [get(v) for v in eqn.invars])
            known.update(zip(eqn.outvars, outs, strict=True))
        return [get(v) for v in jaxpr.outvars]

    def equation(self, eqn: Any, inputs: list[_Fact]) -> list[_Fact]:
        name, n_out = eqn.primitive.name, len(eqn.outvars)
        union = _union(inputs)
        if name == "optimization_barrier" and PER_REPLICA_SCOPE in str(eqn.source_info.name_stack):
            return [dataclasses.replace(self.every, declared=True)] * n_out
        if name == "convert_element_type" and inputs[0].bounds is not None and not _holds(
                eqn.params.get("new_dtype"), inputs[0].bounds):
            # bounds a narrower type may not keep
            return [dataclasses.replace(inputs[0], bounds=None)] * n_out
        # keeps a declaration and bounds (the probe's ``x[None]``)
        if name in _RESHAPING and len(inputs) == 1:
            return [inputs[0]] * n_out
        if name in _ONE_FOR_ONE and len(inputs) == n_out:
            return list(inputs)
        if name in REDUCING or name in SPREADING:
            spanned = self.replica(eqn.params.get("axes", eqn.params.get("axis_name")))
            grouped = eqn.params.get("axis_index_groups") is not None
            if name in REDUCING and not grouped:
                return [_Fact(union.axes - spanned)] * n_out
            return [_Fact(union.axes | spanned)] * n_out
        if name == "axis_index":
            named = eqn.params.get("axis_name")
            named = (named,) if isinstance(named, str) else tuple(named or ())
            spanned = self.replica(named)
            sizes = [self.sizes.get(a) for a in named]
            top = math.prod(sizes) - 1 if sizes and None not in sizes else None
            return [_Fact(spanned, bounds=None if top is None else (0, top))] * n_out
        if name in _COMPARE:
            known = self.compare(name, inputs)
            if known is not None:
                return [known] * n_out
        if (name == "select_n" and inputs[0].bounds is not None
                and inputs[0].bounds[0] == inputs[0].bounds[1]):
            # a predicate the same and known on every replica picks one case
            case = inputs[0].bounds[0] + 1
            if case < len(inputs):
                return [inputs[case]] * n_out
        if name in ("add", "sub", "max", "min") and all(f.bounds
                                                        for f in inputs) and len(inputs) == 2:
            (a0, a1), (b0, b1) = inputs[0].bounds, inputs[1].bounds
            bounds = {"add": (a0 + b0, a1 + b1), "sub": (a0 - b1, a1 - b0),
                      "max": (max(a0, b0), max(a1, b1)), "min": (min(a0, b0), min(a1, b1))}[name]
            return [_Fact(frozenset() if bounds[0] == bounds[1] else union.axes,
                          bounds=bounds)] * n_out
        if name == "cond":
            return self.cond(eqn, inputs)
        if name == "scan":
            return self.scan(eqn, inputs)
        if name == "while":
            return self.loop(eqn, inputs)
        if name in CALLS:
            inner = next((eqn.params[k] for k in ("jaxpr", "call_jaxpr")
                          if _is_jaxpr(eqn.params.get(k))), None)
            if inner is not None:
                return self.read(inner, inputs)
            return [self.every] * n_out
        if name in PURE:
            inner = [p for p in _jaxprs(eqn.params)]
            if all(self.pure(j) for j in inner):  # a reduction's own computation, say: pure too
                return [_Fact(union.axes)] * n_out
        return [self.every] * n_out  # not known: not proven

    def compare(self, name: str, inputs: list[_Fact]) -> _Fact | None:
        if len(inputs) != 2 or inputs[0].bounds is None or inputs[1].bounds is None:
            return None
        true, false = _COMPARE[name](inputs[0].bounds, inputs[1].bounds)
        if true or false:
            return _Fact(frozenset(), bounds=(int(true), int(true)))
        return None

    def pure(self, jaxpr: Any) -> bool:
        return all(e.primitive.name in PURE and all(self.pure(j) for j in _jaxprs(e.params))
                   for e in _open(jaxpr).eqns)

    def cond(self, eqn: Any, inputs: list[_Fact]) -> list[_Fact]:
        index, operands = inputs[0], inputs[1:]
        branches = eqn.params["branches"]
        if (index.bounds is not None and index.bounds[0] == index.bounds[1]
                and 0 <= index.bounds[0] < len(branches)):
            # the same branch on every replica
            return self.read(branches[index.bounds[0]], operands)
        outs = [self.read(b, operands) for b in branches]
        return [_Fact(index.axes | _union([b[i] for b in outs]).axes)
                for i in range(len(eqn.outvars))]

    def scan(self, eqn: Any, inputs: list[_Fact]) -> list[_Fact]:
        n_consts, n_carry = _scan_parts(eqn, len(inputs))
        if n_consts is None:
            return [self.every] * len(eqn.outvars)
        consts, carry, xs = (inputs[:n_consts], inputs[n_consts : n_consts + n_carry],
                             inputs[n_consts + n_carry :])
        carry = [_Fact(c.axes | (self.every.axes if c.declared else frozenset())) for c in carry]
        while True:  # a carry only ever gains axes: at most (carries x axes) rounds
            outs = self.read(eqn.params["jaxpr"], consts + carry + xs)
            joined = [_Fact(a.axes | b.axes) for a, b in zip(carry, outs[:n_carry], strict=True)]
            if joined == carry:
                return carry + [_Fact(o.axes | (self.every.axes if o.declared else frozenset()))
                                for o in outs[n_carry:]]
            carry = joined

    def loop(self, eqn: Any, inputs: list[_Fact]) -> list[_Fact]:
        n_cond, n_body = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        cond_consts, body_consts = inputs[:n_cond], inputs[n_cond:n_cond + n_body]
        carry = [_Fact(c.axes) for c in inputs[n_cond + n_body:]]
        while True:
            test = _union(self.read(eqn.params["cond_jaxpr"], cond_consts + carry))
            outs = self.read(eqn.params["body_jaxpr"], body_consts + carry)
            # a trip count that may differ between replicas makes every carry differ where it may
            joined = [_Fact(a.axes | b.axes | test.axes) for a, b in zip(carry, outs, strict=True)]
            if joined == carry:
                if test.axes:
                    for part in ("cond_jaxpr", "body_jaxpr"):
                        self.stalls += self.collectives(eqn.params[part])
                return carry
            carry = joined

    def collectives(self, jaxpr: Any) -> list[str]:
        """The collectives over replica axes ``jaxpr`` runs (inner jaxprs included), by name."""
        found = []
        for e in _open(jaxpr).eqns:
            named = e.params.get("axes", e.params.get("axis_name"))
            if (e.primitive.name in REDUCING
                or e.primitive.name in SPREADING) and self.replica(named):
                found.append(e.primitive.name)
            for inner in _jaxprs(e.params):
                found += self.collectives(inner)
        return found


def _holds(dtype: Any, bounds: tuple[int, int]) -> bool:
    """Whether integer ``dtype`` (not bool) holds every value within ``bounds``."""
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        return False
    if dtype.kind not in "iu":
        return False
    info = np.iinfo(dtype)
    return info.min <= bounds[0] and bounds[1] <= info.max


def _union(facts: Sequence[_Fact]) -> _Fact:
    axes = frozenset().union(*(f.axes for f in facts)) if facts else frozenset()
    return _Fact(axes)


def _open(jaxpr: Any) -> Any:
    return jaxpr.jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else jaxpr


def _is_jaxpr(value: Any) -> bool:
    return isinstance(value, (jcore.Jaxpr, jcore.ClosedJaxpr))


def _jaxprs(params: Mapping[str, Any]) -> list[Any]:
    found = []
    for p in params.values():
        for item in (p if isinstance(p, (tuple, list)) else (p,)):
            if _is_jaxpr(item):
                found.append(item)
    return found


def _scan_parts(eqn: Any, n_inputs: int) -> tuple[int | None, int]:
    """How many of a scan's operands are constants and carries (jax >= 0.12: by input structure)."""
    if "num_consts" in eqn.params:
        return eqn.params["num_consts"], eqn.params["num_carry"]
    try:
        consts, carry, _ = eqn.params["ft_in"].unpack()
        n_consts, n_carry = len(list(consts)), len(list(carry))
    except (AttributeError, KeyError, TypeError, ValueError):
        return None, 0
    return (n_consts, n_carry) if n_consts + n_carry <= n_inputs else (None, 0)


def _verdict(fact: _Fact) -> str:
    return DECLARED if fact.declared else IDENTICAL if not fact.axes else DIFFERENT


def output_values(jaxpr: Any, varying_inputs: Sequence[frozenset[str] | bool],
                  axes: Mapping[str, int | None] | Sequence[str]) -> list[str]:
    """For each output of a replica function's ``jaxpr``: `IDENTICAL` (proven the same on every
    replica), `DECLARED` (per replica on purpose: ``ReplicaContext.per_replica``) or `DIFFERENT`.

    Args:
        jaxpr: the replica function's jaxpr (a ``Jaxpr`` or ``ClosedJaxpr``), as traced inside
            ``shard_map``.
        varying_inputs: per input of ``jaxpr``, the replica axes over which it may differ (True:
            every one, False: none, as for a mirrored argument).
        axes: the replica axes, with their sizes where known (a collective must span all of them to
            agree).

    Returns:
        One of the three per output; all `DIFFERENT` when the inputs do not match ``jaxpr``'s.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> jaxpr = jax.make_jaxpr(lambda w, x: (w * 2, w * x))(jnp.ones(2), jnp.ones(2))
        >>> output_values(jaxpr, [False, True], ["replica"])
        ['identical', 'different']
    """
    reader = _Reader(axes if isinstance(axes, Mapping) else dict.fromkeys(axes))
    inputs = [_Fact(reader.every.axes if v is True else frozenset() if v is False else frozenset(v))
              for v in varying_inputs]
    return [_verdict(f) for f in reader.read(jaxpr, inputs)]


def _shard_map(program: Any) -> Any:
    eqns = [e for e in _open(program).eqns if e.primitive.name == "shard_map"]
    if len(eqns) != 1:
        # built so in _run.py
        raise AssertionError("strategy.run's probe traces exactly one shard_map")
    return eqns[0]


def program_values(program: Any, axes: Mapping[str, int | None]) -> list[str]:
    """`output_values` of the one ``shard_map`` in ``program`` (the probe of ``strategy.run``), each
    input's facts read from the outside: an input split over replica axes (``in_specs``) differs
    over them; one passed whole (a mirrored argument, a closed-over constant) does not.

    Raises:
        ValueError: for a ``while_loop`` whose trip count may differ between replicas with a
            collective over the replicas inside: a replica that stops early would leave the others
            waiting forever.

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((2,), ("replica",), axis_types=(jax.sharding.AxisType.Auto,),
        ...                      devices=jax.devices()[:2])
        >>> body = lambda w, x: ((w * np.arange(2.0))[None], (w * x)[None])
        >>> f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("replica")), out_specs=P("replica"))
        >>> program_values(jax.make_jaxpr(f)(jnp.ones(2), jnp.ones(4)), {"replica": 2})
        ['identical', 'different']
    """
    eqn = _shard_map(program)
    reader = _Reader(axes)
    outer = _outer_facts(program, reader)
    inputs = [_Fact(outer(v).axes | reader.replica(_spec_axes(spec)))
              for v, spec in zip(eqn.invars, eqn.params["in_specs"], strict=True)]
    values = [_verdict(f) for f in reader.read(eqn.params["jaxpr"], inputs)]
    if reader.stalls:
        raise ValueError(_stall_message(sorted(set(reader.stalls))))
    return values


def _stall_message(collectives: list[str]) -> str:
    return ("a while_loop whose trip count may differ between replicas (its condition is computed "
            "from a replica's own values) runs a collective over the replicas inside "
            f"({', '.join(collectives)}): a replica that stops early leaves the others waiting for "
            "it forever (XLA aborts after a rendezvous timeout). Make the condition the same on "
            "every replica (combine what it reads first, e.g. "
            "jd.get_replica_context().all_reduce(jd.ReduceOp.SUM, residual), or loop a fixed "
            "number of times with lax.fori_loop / lax.scan), or move the collective out of the "
            "loop.")


def _outer_facts(program: Any, reader: _Reader) -> Any:
    jaxpr = _open(program)
    outer_inputs = set(jaxpr.invars) | set(jaxpr.constvars)

    # outside the shard_map a value is one value; computed there: not known
    def fact(v: Any) -> _Fact:
        return _SAME if isinstance(v, jcore.Literal) or v in outer_inputs else reader.every
    return fact


def _spec_axes(spec: Any) -> list[str]:
    names: list[str] = []
    for entry in tuple(spec):
        names += [entry] if isinstance(entry, str) else list(entry or ())
    return names


# How an update reaches an output from the value it updates: passed on as it is (one for one),
# summed with others (``p - lr * g``, ``max(p, 0)``), scaled by a number (``b1 * mu``, ``p * (1 - lr
# * wd)``), selected.
_PASSED = frozenset({"convert_element_type", "copy", "pvary", "optimization_barrier",
                     "reduce_precision", "sharding_constraint", "reshard", "device_put"})
_SUMMED = frozenset({"add", "sub", "add_any", "max", "min"})
_SCALED = frozenset({"mul", "div"})
_SAME_ELEMENTS = frozenset({"broadcast_in_dim", "reshape", "squeeze"})


def _size(var: Any) -> int | None:
    shape = getattr(getattr(var, "aval", None), "shape", None)
    return None if shape is None else int(np.prod(shape))


def _backward(eqn: Any) -> bool:
    """An equation of a backward pass (JAX names it ``transpose(...)``): it computes a gradient."""
    return "transpose(" in str(eqn.source_info.name_stack)


def _carry(jaxpr: Any, inputs: list[frozenset[int]]) -> list[frozenset[int]]:
    jaxpr = _open(jaxpr)
    if len(jaxpr.invars) != len(inputs):
        return [frozenset()] * len(jaxpr.outvars)
    known: dict[Any, frozenset[int]] = dict(zip(jaxpr.invars, inputs, strict=True))
    # values that are one number, broadcast or not (a learning rate, a decay)
    numbers: set[Any] = set()

    def get(v: Any) -> frozenset[int]:
        return frozenset() if isinstance(v, jcore.Literal) else known.get(v, frozenset())

    def number(v: Any) -> bool:
        return isinstance(v, jcore.Literal) or v in numbers or _size(v) == 1

    for eqn in jaxpr.eqns:
        name, given = eqn.primitive.name, [get(v) for v in eqn.invars]
        n_out = len(eqn.outvars)
        shape = getattr(eqn.outvars[0].aval, "shape", None) if eqn.outvars else None
        if name == "broadcast_in_dim" and number(eqn.invars[0]):
            numbers.update(eqn.outvars)
        inner = next((eqn.params[k] for k in ("jaxpr", "call_jaxpr")
                      if _is_jaxpr(eqn.params.get(k))), None)
        if _backward(eqn):
            outs = [frozenset()] * n_out
        elif name in CALLS and inner is not None:
            outs = _carry(inner, given)
        elif name == "cond":
            branches = [_carry(b, given[1:]) for b in eqn.params["branches"]]
            outs = [frozenset().union(*(b[i] for b in branches)) for i in range(n_out)]
        elif name in ("scan", "while"):
            outs = _carry_loop(eqn, given)
        elif (name in _SAME_ELEMENTS and eqn.invars
              and _size(eqn.invars[0]) == _size(eqn.outvars[0])):
            outs = [given[0]] * n_out  # the same elements (the probe's ``x[None]``)
        elif name in _PASSED:
            outs = given if len(given) == n_out else [given[0]] * n_out
        elif name in _SUMMED or name in ("select_n", "clamp"):
            picked = {"select_n": eqn.invars[1:], "clamp": eqn.invars[1:2]}.get(name, eqn.invars)
            outs = [frozenset().union(
                *(get(v) for v in picked if getattr(v.aval, "shape", None) == shape))] * n_out
        elif name in _SCALED and len(eqn.invars) == 2:
            a, b = eqn.invars
            carried = (get(a) if number(b) else get(b) if name == "mul" and number(a)
                       else frozenset())
            outs = [carried if getattr((a if number(b) else b).aval, "shape", None) == shape
                    else frozenset()] * n_out
        else:
            outs = [frozenset()] * n_out
        known.update(zip(eqn.outvars, outs, strict=True))
    return [get(v) for v in jaxpr.outvars]


def _carry_loop(eqn: Any, given: list[frozenset[int]]) -> list[frozenset[int]]:
    """A loop's carries carry what they start from and what the body adds (to a fixed point)."""
    if eqn.primitive.name == "scan":
        n_consts, n_carry = _scan_parts(eqn, len(given))
        if n_consts is None:
            return [frozenset()] * len(eqn.outvars)
        body, head, carry, tail = (eqn.params["jaxpr"], given[:n_consts],
                                   given[n_consts : n_consts + n_carry],
                                   given[n_consts + n_carry :])
    else:
        n_cond, n_body = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        body, head, carry, tail = eqn.params["body_jaxpr"], given[n_cond:n_cond + n_body], \
            given[n_cond + n_body:], []
    while True:
        outs = _carry(body, head + carry + tail)
        joined = [a | b for a, b in zip(carry, outs[:len(carry)], strict=True)]
        if joined == carry:
            return carry + [frozenset()] * (len(eqn.outvars) - len(carry))
        carry = joined


def updated_inputs(program: Any) -> list[frozenset[int]]:
    """For each output of the one ``shard_map`` in ``program``, the inputs of ``program`` it takes
    the place of: reached from them by element-wise arithmetic (any depth of nesting, casts,
    selects, loops), outside a backward pass. ``params - lr * grads`` carries ``params``; a gradient
    carries nothing (JAX computes it in its backward pass, even a weight-decay ``wd * params``).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((2,), ("replica",), axis_types=(jax.sharding.AxisType.Auto,),
        ...                      devices=jax.devices()[:2])
        >>> def body(w, x):
        ...     g = jax.grad(lambda w: jnp.sum((x @ w) ** 2) + jnp.sum(w ** 2))(w)
        ...     return (w - 0.1 * g)[None], g[None]
        >>> f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("replica")), out_specs=P("replica"))
        >>> updated_inputs(jax.make_jaxpr(f)(jnp.ones((2, 2)), jnp.ones((4, 2))))
        [frozenset({0}), frozenset()]
    """
    eqn = _shard_map(program)
    positions = {v: i for i, v in enumerate(_open(program).invars)}
    inputs = [frozenset({positions[v]}) if v in positions else frozenset() for v in eqn.invars]
    return _carry(eqn.params["jaxpr"], inputs)


def _dtype(dtype: Any) -> Any:
    """``dtype`` comparable with another: numpy's, or JAX's own (a key's ``key<fry>``) as is."""
    return dtype if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) else np.dtype(dtype)


def check_mirrored_outputs(fn: str, treedef: Any, roles: Sequence[Role], out_paths: Sequence[str],
                           out_kinds: Sequence[str], out_updates: Sequence[frozenset[int]]) -> None:
    """Refuse a replica function whose output takes the place of a mirrored argument but may differ
    between replicas: tf.distribute refuses to update a mirrored variable from replica context
    without aggregating, and a value so returned and fed back as the variable drifts apart silently.

    An output takes an argument's place when it is reached from it element-wise outside a backward
    pass (`updated_inputs`: ``params - lr * grads`` does, however deep in the output, as a lone
    array or cast to another dtype; a gradient does not). It is refused when it is not proven the
    same on every replica (`program_values`) and was not declared per replica.

    Args:
        fn: the replica function's name, for the message.
        treedef, roles: the structure of ``(args, kwargs)`` and each leaf's role.
        out_paths, out_kinds: per output leaf that is a value, its path and how it leaves the
            program ("per_replica" where its replicas' values may differ).
        out_updates: per output leaf, the positions among the array arguments (those whose role is
            not static) that it takes the place of (`updated_inputs`).

    Raises:
        ValueError: naming the output, the argument it replaces, and the two fixes (all-reduce the
            gradients; declare the value per replica on purpose).
    """
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        jax.tree.unflatten(treedef, list(range(treedef.num_leaves))))[0]]
    arguments = [("args" if p.startswith("[0]") else "kwargs") + p[3:]
                 for p, role in zip(paths, roles, strict=True) if role != Role.STATIC]
    variables = {i for i, role in enumerate(r for r in roles if r != Role.STATIC)
                 if role == Role.VARIABLE}
    found = [(where, arguments[i])
             for where, kind, updates in zip(out_paths, out_kinds, out_updates, strict=True)
             if kind == "per_replica" for i in sorted(updates & variables)[:1]]
    if found:
        raise ValueError(_message(fn, found))


def _message(fn: str, found: list[tuple[str, str]]) -> str:
    shown = ", ".join(f"{out} takes the place of the mirrored argument {arg}"
                      for out, arg in found[:3]) + (
        f" and {len(found) - 3} more outputs do" if len(found) > 3 else "")
    return (f"strategy.run({fn}): {shown}, computed from it but differing between replicas: each "
            "replica updated its own copy, e.g. with its local gradients, and the copies drift "
            "apart. tf.distribute's optimizer.apply_gradients all-reduces the gradients for you; "
            "here, combine them before the update: grads = "
            "jd.get_replica_context().all_reduce(jd.ReduceOp.SUM, grads) (SUM of losses scaled by "
            "jd.compute_average_loss; MEAN of plain per-replica means). A value each replica keeps "
            "apart on purpose (local SGD, an ensemble, a residual) is declared where it is "
            "returned: jd.get_replica_context().per_replica(new_value); it then comes back as "
            "jd.PerReplica.")
