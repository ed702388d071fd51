"""Gradients: cluster tagging carried through `jax.grad` as named-scope metadata."""

from jaxdist.gradients.clusters import cluster as cluster
from jaxdist.gradients.clusters import cluster_of as cluster_of
from jaxdist.gradients.clusters import clusters as clusters
from jaxdist.gradients.clusters import current_cluster as current_cluster
from jaxdist.gradients.clusters import current_gradient_uid as current_gradient_uid
from jaxdist.gradients.clusters import grad as grad
from jaxdist.gradients.clusters import gradient_cluster as gradient_cluster
from jaxdist.gradients.clusters import value_and_grad as value_and_grad
from jaxdist.gradients.clusters import vjp as vjp

__all__ = [
    "cluster",
    "cluster_of",
    "clusters",
    "current_cluster",
    "current_gradient_uid",
    "grad",
    "gradient_cluster",
    "value_and_grad",
    "vjp",
]
