"""Gradients: cluster tagging carried through `jax.grad`, and compressing gradient synchronizers."""

from jaxdist.gradients.clusters import cluster as cluster
from jaxdist.gradients.clusters import cluster_of as cluster_of
from jaxdist.gradients.clusters import clusters as clusters
from jaxdist.gradients.clusters import current_cluster as current_cluster
from jaxdist.gradients.clusters import current_gradient_uid as current_gradient_uid
from jaxdist.gradients.clusters import grad as grad
from jaxdist.gradients.clusters import gradient_cluster as gradient_cluster
from jaxdist.gradients.clusters import value_and_grad as value_and_grad
from jaxdist.gradients.clusters import vjp as vjp
from jaxdist.gradients.compressors import CastCompressor as CastCompressor
from jaxdist.gradients.compressors import CastState as CastState
from jaxdist.gradients.compressors import Compressor as Compressor
from jaxdist.gradients.compressors import NoneCompressor as NoneCompressor
from jaxdist.gradients.compressors import PowerSGDCompressor as PowerSGDCompressor
from jaxdist.gradients.compressors import PowerSGDState as PowerSGDState
from jaxdist.gradients.compressors import replica_count as replica_count
from jaxdist.gradients.sparse import SparseRows as SparseRows
from jaxdist.gradients.sparse import all_gather_is_cheaper as all_gather_is_cheaper
from jaxdist.gradients.sparse import is_sparse as is_sparse
from jaxdist.gradients.sparse import sparse_all_reduce as sparse_all_reduce
from jaxdist.gradients.synchronizers import AllReduceSynchronizer as AllReduceSynchronizer
from jaxdist.gradients.synchronizers import SynchronizerState as SynchronizerState

__all__ = ["AllReduceSynchronizer", "CastCompressor", "CastState", "Compressor", "NoneCompressor",
           "PowerSGDCompressor", "PowerSGDState", "SparseRows", "SynchronizerState",
           "all_gather_is_cheaper", "cluster", "cluster_of", "clusters", "current_cluster",
           "current_gradient_uid", "grad", "gradient_cluster", "is_sparse", "replica_count",
           "sparse_all_reduce", "value_and_grad", "vjp"]
