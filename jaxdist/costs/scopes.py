"""Which kernels a compiled program runs, read back from the named scopes jaxdist's layers use.

A mixture-of-experts layer runs its dispatch path in a named scope ``<MOE_SCOPE><path>``
(`moe_dispatch`). A layer that chooses between kernels by backend
(`jaxdist.nn.dot_product_attention`: cuDNN, XLA or einsums; the dropless mixture of experts:
`jax.lax.ragged_dot` or tokamax's grouped matmul) runs the one it chose in a named scope
``<prefix><kernel>``. Named scopes survive compilation as op metadata (``op_name``), so a plan
(`jaxdist.Plan.attention`, `jaxdist.Plan.grouped_matmul`) reports the kernels from the program
itself: what runs, not what was asked for. A strategy's plan reads them from the module it lowered
(a program JAX's persistent compilation cache loads carries the op names of the first one
compiled).

Examples:
    >>> text = ('%d = f32[2] dot(...), '
    ...         'metadata={op_name="jit(f)/jaxdist_attention_cudnn/dot_general"}')
    >>> scoped(text, ATTENTION_SCOPE), scoped(text, GROUPED_MATMUL_SCOPE)
    (('cudnn',), ())
"""

from __future__ import annotations

import re

__all__ = ["ATTENTION_SCOPE", "GROUPED_MATMUL_SCOPE", "MOE_SCOPE", "moe_dispatch", "scoped"]

ATTENTION_SCOPE = "jaxdist_attention_"
"""The prefix of the named scope `jaxdist.nn.dot_product_attention` runs its kernel in."""

MOE_SCOPE = "jaxdist_moe_"
"""The prefix of the named scope a mixture-of-experts layer runs in (``jaxdist_moe_<dispatch
path>``): the compiled module's op names say which dispatch path a program took (`moe_dispatch`)."""

GROUPED_MATMUL_SCOPE = "jaxdist_grouped_matmul_"
"""The prefix of the named scope the dropless mixture of experts runs its grouped matmuls in."""


def scoped(text: str, prefix: str) -> tuple[str, ...]:
    """The names after ``prefix`` in the named scopes of a compiled module's ``text``.

    Args:
        text: a compiled (or lowered) module's text.
        prefix: the scope prefix (`ATTENTION_SCOPE`, `GROUPED_MATMUL_SCOPE`).

    Returns:
        The kernels' names, sorted, each once; empty where no op runs in such a scope.

    Examples:
        >>> scoped('op_name="jit(f)/jaxdist_grouped_matmul_ragged_dot/ragged_dot"',
        ...        GROUPED_MATMUL_SCOPE)
        ('ragged_dot',)
    """
    return tuple(sorted(set(re.findall(re.escape(prefix) + r"(\w+)", text))))


def moe_dispatch(text: str) -> tuple[str, ...]:
    """The dispatch paths of the mixture-of-experts layers in a compiled module's ``text``, by their
    named scope (`MOE_SCOPE`): e.g. ``("dropping_all_to_all",)``; empty for none.

    Examples:
        >>> moe_dispatch('%a = f32[2] add(...), '
        ...              'metadata={op_name="jit(f)/jaxdist_moe_dropless_padded/add"}')
        ('dropless_padded',)
    """
    return scoped(text, MOE_SCOPE)
