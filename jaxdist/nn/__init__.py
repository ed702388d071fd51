"""Layers that need the strategy's mesh: context-parallel attention.

Examples:
    >>> import jaxdist as jd
    >>> callable(jd.nn.dot_product_attention)
    True
"""

from jaxdist.nn.attention import dot_product_attention as dot_product_attention

__all__ = ["dot_product_attention"]
