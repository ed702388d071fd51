"""Layers that need the strategy's mesh: context-parallel attention and pipelines.

Examples:
    >>> import jaxdist as jd
    >>> callable(jd.nn.dot_product_attention)
    True
    >>> jd.nn.Pipeline.__name__, jd.nn.bubble_fraction(4, 8)
    ('Pipeline', 0.2727272727272727)
"""

from jaxdist.nn.attention import dot_product_attention as dot_product_attention
from jaxdist.nn.pipeline import Pipeline as Pipeline
from jaxdist.nn.pipeline import bubble_fraction as bubble_fraction

__all__ = ["Pipeline", "bubble_fraction", "dot_product_attention"]
