"""Layers that need the strategy's mesh: context-parallel attention, pipelines, mixtures of experts.

Examples:
    >>> import jaxdist as jd
    >>> callable(jd.nn.dot_product_attention)
    True
    >>> jd.nn.Pipeline.__name__, jd.nn.bubble_fraction(4, 8)
    ('Pipeline', 0.2727272727272727)

``jd.nn.nnx`` (the layers as Flax nnx modules) is imported when first named, and with it
``flax.nnx``: a linen program never loads nnx.
"""

import lazy_loader

from jaxdist.nn import exchange as exchange
from jaxdist.nn import experts as experts
from jaxdist.nn.attention import dot_product_attention as dot_product_attention
from jaxdist.nn.moe import MoE as MoE
from jaxdist.nn.moe import moe_loss as moe_loss
from jaxdist.nn.moe import update_router_bias as update_router_bias
from jaxdist.nn.pipeline import Pipeline as Pipeline
from jaxdist.nn.pipeline import bubble_fraction as bubble_fraction

__all__ = ["MoE", "Pipeline", "bubble_fraction", "dot_product_attention", "exchange", "experts",
           "moe_loss", "nnx", "update_router_bias"]
__getattr__, __dir__, _ = lazy_loader.attach(__name__, submodules=["nnx"])
