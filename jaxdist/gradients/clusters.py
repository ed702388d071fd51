"""Gradient clusters: named groups of ops whose gradients are named after the gradient invocation.

``with cluster("C"):`` puts the ops traced inside into cluster ``C`` by opening the named scope
``cluster=C``; named scopes travel with every op into the lowered module's metadata, through
`jax.grad`. ``grad`` / ``value_and_grad`` / ``vjp`` give each invocation a gradient uid (``"uid"``,
``"uid_1"``, ... like TF's unique names) and trace the differentiation inside the named scope
``gradient=<uid>``.

`clusters` reads the metadata back. The rule is the one TF used to colocate gradients with
``outside_compilation`` clusters: the gradient of an op in cluster ``C`` taken in invocation ``u``
belongs to cluster ``C.u``; a gradient of that gradient (invocation ``u2``) to ``C.u.u2`` — the uid
of the invocation that produced an op is always the suffix after the last ``.``. An op is in the
backward pass of invocation ``u`` when the scope right after ``gradient=u`` in its name stack is
wrapped in ``transpose(...)``, which is how JAX names what it transposes.

Plain `jax.grad` works on code with clusters too; its gradient ops just carry no uid.

Any code can tag and read clusters. `jaxdist.tpu.outside_compilation` builds on them: each host
region is cluster "0", "1", ... of its computation, and its VJP runs as host region ``C.uid``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jaxdist.strategies.ambient import current_computation, state

__all__ = ["cluster", "cluster_of", "clusters", "current_cluster", "current_gradient_uid",
           "gradient_cluster", "grad", "value_and_grad", "vjp"]

_CLUSTER = "cluster="
_GRADIENT = "gradient="
_LOC = re.compile(r'loc\("([^"]*)"')
_uids = itertools.count()
_uid_lock = threading.Lock()


def _next_uid() -> str:
    """Numbered per strategy computation (deterministic names); process-wide outside one."""
    frame = current_computation()
    if frame is not None:
        n = frame.counter("gradient_uid")
    else:
        with _uid_lock:
            n = next(_uids)
    return "uid" if n == 0 else f"uid_{n}"


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name or any(c in name for c in '/()"'):
        raise ValueError(
            f"name={name!r} is not a valid cluster name: use a non-empty string without '/', '(', "
            "')' or '\"'.")
    return name


# lower case: used like a function, as contextlib.contextmanager
class cluster(contextlib.ContextDecorator):
    """Put the ops traced inside into gradient cluster ``name`` (a context manager and a decorator).

    Args:
        name: the cluster's name (no ``/``, parentheses or quotes).

    Raises:
        ValueError: for an empty or malformed name.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxdist as jd
        >>> def f(x):
        ...     with jd.gradients.cluster("C"):
        ...         y = jnp.sin(x)
        ...     return jnp.sum(y)
        >>> lowered = jax.jit(jd.gradients.grad(f)).lower(jnp.ones(3))
        >>> sorted(jd.gradients.clusters(lowered))[0]
        'C'
    """

    def __init__(self, name: str):
        self.name = _check_name(name)
        self._scopes: list[Any] = []

    def __enter__(self) -> cluster:
        scope = jax.named_scope(_CLUSTER + self.name)
        scope.__enter__()
        self._scopes.append(scope)
        state.clusters.append(self.name)
        return self

    def __exit__(self, *exc: Any) -> None:
        state.clusters.pop()
        self._scopes.pop().__exit__(*exc)


def current_cluster() -> str | None:
    """The innermost cluster open while tracing (None outside any).

    Examples:
        >>> import jaxdist as jd
        >>> with jd.gradients.cluster("C"):
        ...     jd.gradients.current_cluster()
        'C'
    """
    return state.clusters[-1] if state.clusters else None


def current_gradient_uid() -> str | None:
    """The uid of the innermost `grad` / `value_and_grad` / `vjp` invocation traced (None outside).

    Examples:
        >>> import jaxdist as jd
        >>> jd.gradients.current_gradient_uid() is None
        True
    """
    return state.gradient_uids[-1] if state.gradient_uids else None


def gradient_cluster(name: str, uid: str | None) -> str:
    """The cluster that the gradient, taken in invocation ``uid``, of an op in cluster ``name``
    belongs to (TF's rule, see the module doc): a gradient of a gradient (a new uid) appends its
    uid; without a uid (plain `jax.grad`) the gradient stays in ``name``.

    Examples:
        >>> (gradient_cluster("C", "uid"), gradient_cluster("C.uid", "uid"),
        ...  gradient_cluster("C.uid", "uid_1"))
        ('C.uid', 'C.uid', 'C.uid.uid_1')
    """
    if uid is None or name.rsplit(".", 1)[-1] == uid:
        return name
    return f"{name}.{uid}"


@contextlib.contextmanager
def _invocation(uid: str | None = None) -> Iterator[str]:
    uid = uid or _next_uid()
    state.gradient_uids.append(uid)
    try:
        with jax.named_scope(_GRADIENT + uid):
            yield uid
    finally:
        state.gradient_uids.pop()


def grad(fun: Callable, argnums: int | tuple[int, ...] = 0, has_aux: bool = False,
         **kwargs: Any) -> Callable:
    """`jax.grad` (its arguments) whose every invocation gets a gradient uid, so cluster ``C``'s
    gradient lands in ``C.uid``.

    Examples:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> float(jd.gradients.grad(lambda x: x ** 2)(3.0))
        6.0
    """
    return _per_invocation(fun, jax.grad(fun, argnums=argnums, has_aux=has_aux, **kwargs))


def _per_invocation(fun: Callable, transformed: Callable) -> Callable:
    """``transformed`` (a gradient of ``fun``) traced under a fresh gradient uid at every call."""

    @functools.wraps(fun)
    def invoke(*args: Any, **kw: Any) -> Any:
        with _invocation():
            return transformed(*args, **kw)

    return invoke


def value_and_grad(fun: Callable, argnums: int | tuple[int, ...] = 0, has_aux: bool = False,
                   **kwargs: Any) -> Callable:
    """`jax.value_and_grad` with one gradient uid per invocation (see `grad`).

    Examples:
        >>> import jaxdist as jd
        >>> value, g = jd.gradients.value_and_grad(lambda x: x ** 2)(3.0)
        >>> float(value), float(g)
        (9.0, 6.0)
    """
    return _per_invocation(fun, jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux, **kwargs))


def vjp(fun: Callable, *primals: Any, has_aux: bool = False) -> Any:
    """`jax.vjp` with one gradient uid per invocation: the returned pullback traces under that uid.

    Examples:
        >>> import jaxdist as jd
        >>> y, pullback = jd.gradients.vjp(lambda x: x * 3.0, 2.0)
        >>> float(y), float(pullback(1.0)[0])
        (6.0, 3.0)
    """
    with _invocation() as uid:
        out = jax.vjp(fun, *primals, has_aux=has_aux)
    pullback = out[1]

    def scoped_pullback(*cotangents: Any) -> Any:
        with _invocation(uid):
            return pullback(*cotangents)

    return (out[0], scoped_pullback, *out[2:])


def _unwrap(component: str) -> tuple[str, bool]:
    """``transpose(jvp(NAME))`` -> (``NAME``, True): the scope name, whether it was transposed."""
    transposed = component.startswith("transpose(")
    while "(" in component and component.endswith(")"):
        head = component.index("(")
        if not re.fullmatch(r"[A-Za-z_]+", component[:head]):
            break
        component = component[head + 1 : -1]
    return component, transposed


def cluster_of(name_stack: str) -> str | None:
    """The cluster an op belongs to, from its name stack
    (``jit(f)/gradient=uid/transpose(jvp(cluster=C))/mul``).

    Examples:
        >>> cluster_of("jit(f)/gradient=uid/transpose(jvp(cluster=C))/mul")
        'C.uid'
        >>> (cluster_of("jit(f)/gradient=uid/jvp(cluster=C)/sin") is None
        ...  or cluster_of("jit(f)/jvp(cluster=C)/sin"))
        'C'
    """
    unwrapped = [_unwrap(p) for p in name_stack.split("/")]
    base = None
    for name, _ in unwrapped:
        if name.startswith(_CLUSTER):
            base = name[len(_CLUSTER) :]
    if base is None:
        return None
    backward_uids = [name[len(_GRADIENT) :] for (name, _), (_, transposed)
                     in itertools.pairwise(unwrapped) if name.startswith(_GRADIENT) and transposed]
    # innermost invocation first: the first-order gradient's uid, then its gradient's
    for uid in reversed(backward_uids):
        base = gradient_cluster(base, uid)
    return base


def clusters(lowered_or_text: Any) -> dict[str, list[str]]:
    """``{cluster: [op names]}`` read back from a lowered computation's op metadata.

    Args:
        lowered_or_text: a `jax.stages.Lowered` (``jax.jit(f).lower(...)``,
            ``strategy.jit(f).lower(...)``) or its text with debug info.

    Returns:
        Each cluster's ops, as their full name stacks (``.../transpose(jvp(cluster=C))/mul``),
        sorted.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxdist as jd
        >>> def f(x):
        ...     with jd.gradients.cluster("C"):
        ...         return jnp.sum(jnp.sin(x))
        >>> step = jd.OneDeviceStrategy().jit(jd.gradients.grad(f))
        >>> sorted(jd.gradients.clusters(step.lower(jnp.ones(2))))
        ['C', 'C.uid']
    """
    if isinstance(lowered_or_text, str):
        text = lowered_or_text
    elif hasattr(lowered_or_text, "as_text"):
        text = lowered_or_text.as_text(debug_info=True)
    else:
        raise TypeError(
            f"lowered_or_text={type(lowered_or_text).__name__} is neither a lowered computation "
            "nor text: pass jax.jit(f).lower(*args) or its .as_text(debug_info=True).")
    out: dict[str, set[str]] = {}
    for stack in _LOC.findall(text):
        name = cluster_of(stack)
        if name is not None:
            out.setdefault(name, set()).add(stack)
    return {k: sorted(v) for k, v in sorted(out.items())}
