"""Which kernels a compiled program runs, read back from the named scopes jaxdist's layers trace them in.

A layer that chooses between kernels by backend (`jaxdist.nn.dot_product_attention`: cuDNN, XLA or einsums;
the dropless mixture of experts: `jax.lax.ragged_dot` or tokamax's grouped matmul) runs the one it chose in a
named scope ``<prefix><kernel>``. Named scopes survive compilation as op metadata (``op_name``), so a plan
(`jaxdist.Plan.attention`, `jaxdist.Plan.grouped_matmul`) reports the kernels from the program itself: what
ran, not what was asked for.

Examples:
    >>> text = '%d = f32[2] dot(...), metadata={op_name="jit(f)/jaxdist_attention_cudnn/dot_general"}'
    >>> scoped(text, ATTENTION_SCOPE), scoped(text, GROUPED_MATMUL_SCOPE)
    (('cudnn',), ())
"""

from __future__ import annotations

import re

__all__ = ["ATTENTION_SCOPE", "GROUPED_MATMUL_SCOPE", "scoped"]

ATTENTION_SCOPE = "jaxdist_attention_"
"""The prefix of the named scope `jaxdist.nn.dot_product_attention` runs its kernel in."""

GROUPED_MATMUL_SCOPE = "jaxdist_grouped_matmul_"
"""The prefix of the named scope the dropless mixture of experts runs its grouped matmuls in."""


def scoped(text: str, prefix: str) -> tuple[str, ...]:
    """The names after ``prefix`` in the named scopes of a compiled module's ``text``, sorted, each once.

    Args:
        text: a compiled (or lowered) module's text.
        prefix: the scope prefix (`ATTENTION_SCOPE`, `GROUPED_MATMUL_SCOPE`).

    Returns:
        The kernels' names; empty where no op runs in such a scope.

    Examples:
        >>> scoped('op_name="jit(f)/jaxdist_grouped_matmul_ragged_dot/ragged_dot"', GROUPED_MATMUL_SCOPE)
        ('ragged_dot',)
    """
    return tuple(sorted(set(re.findall(re.escape(prefix) + r"(\w+)", text))))
