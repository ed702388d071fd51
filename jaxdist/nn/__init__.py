"""Layers that need the strategy's mesh.

Examples:
    >>> import jaxdist as jd
    >>> jd.nn.Pipeline.__name__, jd.nn.bubble_fraction(4, 8)
    ('Pipeline', 0.2727272727272727)
"""

from jaxdist.nn.pipeline import Pipeline as Pipeline
from jaxdist.nn.pipeline import bubble_fraction as bubble_fraction

__all__ = ["Pipeline", "bubble_fraction"]
