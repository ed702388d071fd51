"""Layers that need the strategy's mesh: the pipeline layer (`Pipeline`).

Examples:
    >>> import jaxdist as jd
    >>> jd.nn.Pipeline.__name__
    'Pipeline'
"""

from jaxdist.nn.pipeline import SCHEDULES as SCHEDULES, Pipeline as Pipeline, bubble_fraction as bubble_fraction

__all__ = ["SCHEDULES", "Pipeline", "bubble_fraction"]
