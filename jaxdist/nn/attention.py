"""Attention on a split sequence (context parallelism): all-gather and ring attention, load balance.

A `ShardedStrategy` with context axes (``context_axes=("context",)`` or ``context_parallelism=N``)
splits a batch's sequence dimension over them. Attention is the one layer where a token needs every
other token: inside ``strategy.jit``, `dot_product_attention` computes it on the split sequence:

* ``context="all_gather"``: each device keeps its queries and gathers the keys and values of the
  whole sequence along the context axes (`jax.lax.all_gather`; the backward pass reduce-scatters
  their gradients), then folds them in one ``(L / N)``-long block at a time. Memory per device: K/V
  of the whole sequence. One collective per attention call: the fast choice while K/V fit (few KV
  heads, moderate L).
* ``context="ring"``: each device keeps its queries and passes its K/V block around the ring of
  context devices (`jax.lax.ppermute`), folding in each block as it arrives; the next block's
  transfer is independent of the current block's compute, so XLA can overlap them. Memory per
  device: two K/V blocks in flight (autodiff keeps each block seen for the backward pass). N - 1
  transfers per call: the choice when whole-sequence K/V do not fit, or the interconnect is a ring.

Both accumulate the output with an online softmax (flash-attention style), one ``(L / 2N, L / 2N)``
score block at a time, each block rematerialised in the backward pass (`jax.checkpoint`), so the
attention's activation memory stays ``O(L / N)`` per device; blocks that a causal mask hides
entirely are skipped.

Causal masks are never materialised as ``(L, L)``: each block builds its part from token positions.
``load_balance=True`` gives every context device the same causal work (`jaxdist.nn.load_balance`'s
zig-zag order) and puts the output back in the original order: transparent to model and loss.

Off a context axis (one device, a strategy without context axes, code outside a strategy's step) the
same function computes plain attention with the same formula: a model equals itself on one device.

Kernels (``implementation=``, `IMPLEMENTATIONS`): on an NVIDIA GPU, plain attention and the
all-gather run cuDNN's fused flash attention (8x the XLA-compiled einsums' FLOP/s on an H100); the
ring always runs the einsums. The kernel runs in a named scope (`jaxdist.costs.scopes`), so
`jaxdist.Plan.attention` reports what a compiled step runs.

Semantics shared by every path: scores are ``q . k / sqrt(head_dim)`` (plus ``bias``), masked by
``mask`` (True: attend), ``causal`` (query position >= key position) and ``segment_ids`` (same
segment: packed sequences); the softmax runs in at least float32; a query that may attend to no key
at all (a padding position) gets zeros.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxdist.costs.scopes import ATTENTION_SCOPE
from jaxdist.nn.load_balance import positions as _positions
from jaxdist.nn.load_balance import unzigzag as _unzigzag
from jaxdist.nn.load_balance import zigzag as _zigzag
from jaxdist.nn.optional import tokamax as _tokamax  # None without the extra jaxdist[tokamax]
from jaxdist.replicate.layouts import entry_axes
from jaxdist.strategies import ambient
from jaxdist.strategies.layout import explicit_axes, trace_mesh
from jaxdist.strategies.plan import is_plan_mesh

__all__ = ["IMPLEMENTATIONS", "dot_product_attention"]

_MODES = ("all_gather", "ring")
IMPLEMENTATIONS = ("einsum", "xla", "cudnn", "tokamax")
"""What computes each attention block: ``"einsum"`` (jaxdist's blockwise online softmax, every
backend), ``"xla"`` (`jax.nn.dot_product_attention` with ``implementation="xla"``, every backend),
``"cudnn"`` (`jax.nn.dot_product_attention` with ``implementation="cudnn"``: cuDNN's fused flash
attention, NVIDIA GPUs), ``"tokamax"`` (``tokamax.dot_product_attention``: Pallas flash attention
for GPUs and TPUs, its XLA one elsewhere; the optional extra ``jaxdist[tokamax]``)."""
_FUSED = ("xla", "cudnn", "tokamax")
_FUSED_DTYPES = (jnp.bfloat16, jnp.float16)
_UNROLL = 8  # ring steps unrolled up to this many (a longer ring stays a loop)


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    causal: bool = False,
    segment_ids: jax.Array | None = None,
    context: str | None = "all_gather",
    load_balance: bool = False,
    implementation: str | None = None,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    broadcast_dropout: bool = True,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    is_causal: bool = False,
    force_fp32_for_softmax: bool = False,
    qk_attn_weights_einsum: Any = None,
    attn_weights_value_einsum: Any = None,
    promote_dtype: Any = None,
    **flax_kwargs: Any,
) -> jax.Array:
    """Dot-product attention that is correct and cheap on a sequence split over context axes.

    A drop-in Flax ``attention_fn`` (linen ``nn.MultiHeadDotProductAttention`` /
    ``nn.SelfAttention``, nnx ``nnx.MultiHeadAttention``):
    ``functools.partial(jd.nn.dot_product_attention, causal=True, context="ring")``. Inside
    ``strategy.jit`` of a strategy with context axes it runs the context-parallel algorithm
    ``context`` names (see the module doc); anywhere else it is plain attention.

    Args:
        query: ``(batch, q_length, heads, head_dim)`` (Flax's layout; off a context axis any leading
            batch dimensions).
        key: ``(batch, kv_length, heads, head_dim)``.
        value: ``(batch, kv_length, heads, v_dim)``.
        bias: added to the scores; broadcastable to ``(batch, heads, q_length, kv_length)``.
        mask: True where a query may attend to a key; broadcastable to ``(batch, heads, q_length,
            kv_length)`` (padding masks, Flax's ``make_attention_mask``).
        causal: a query attends only to keys at or before its position (no ``(L, L)`` mask built).
        segment_ids: ``(batch, length)`` ints: a query attends only to keys of its own segment
            (packed sequences).
        context: ``"all_gather"`` or ``"ring"`` on a context axis; None: plain attention even there
            (XLA gathers the sequence; for comparison).
        load_balance: with ``causal``: reorder the sequence into ``2 N`` zig-zag chunks so every
            context device does the same work (two collective permutes each way; the output comes
            back in the original order).
        implementation: what computes each block, one of `IMPLEMENTATIONS` (``"cudnn"``: NVIDIA
            GPUs, float16/bfloat16, head_dim a multiple of 8 up to 128). None: where a fused kernel
            serves the case (no dropout, no sown weights, no ``precision``, not ``context="ring"``),
            cuDNN on an NVIDIA GPU (float16/bfloat16) and tokamax on a TPU where it is installed;
            the einsums elsewhere. With ``context="all_gather"`` a fused kernel computes the local
            queries against the gathered keys in one call (its ``(local q, L)`` mask built from
            token positions); the ring runs the einsums: it needs each block's softmax statistics
            with their gradient, which the fused kernels do not give (the ``return_residual`` of
            `jax.nn.dot_product_attention` has none under cuDNN). The choice shows in
            `jaxdist.Plan.attention`.
        dropout_rng: Flax's attention dropout key (plain attention only: on a context axis, pass
            ``deterministic=True`` or ``dropout_rate=0``).
        dropout_rate: Flax's attention dropout rate (plain attention only).
        broadcast_dropout: Flax's: one dropout mask for every batch row and head.
        deterministic: Flax's: no dropout.
        dtype: the computation dtype (default: the inputs'); the softmax runs in at least float32.
        precision: the matmuls' `jax.lax.Precision`.
        module: Flax's module when it sows the attention weights (plain attention only).
        is_causal: Flax nnx's name for ``causal`` (either one turns the causal mask on).
        force_fp32_for_softmax: accepted from Flax's modules (the softmax is in float32 already).
        qk_attn_weights_einsum: accepted from Flax's modules (a custom einsum is not supported).
        attn_weights_value_einsum: accepted from Flax's modules (a custom einsum is not supported).
        promote_dtype: accepted from Flax's modules.
        **flax_kwargs: any other keyword a Flax module passes; an unknown one is an error.

    Returns:
        ``(batch, q_length, heads, v_dim)``, laid out like ``query``.

    Raises:
        ValueError: for an unknown ``context`` or ``implementation``, ``implementation="cudnn"`` off
            an NVIDIA GPU, ``"tokamax"`` without tokamax, ``load_balance`` without ``causal``, or on
            a context axis a sequence length the context axes do not divide (``2 N`` chunks with
            ``load_balance``), query and key lengths that differ, inputs that are not ``(batch,
            length, heads, head_dim)``.
        NotImplementedError: for dropout or sowing weights on a context axis or with a fused
            ``implementation``, a fused ``implementation`` with ``context="ring"``, or custom
            einsums.
        TypeError: for a keyword argument it does not know.

    Examples:
        >>> import functools, jax, jax.numpy as jnp, jaxdist as jd
        >>> q = k = v = jax.random.normal(jax.random.key(0), (2, 8, 4, 16))
        >>> out = jd.nn.dot_product_attention(q, k, v, causal=True)
        >>> ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        >>> out.shape, bool(jnp.allclose(out, ref, atol=1e-5))
        ((2, 8, 4, 16), True)
        >>> import flax.linen as nn  # a drop-in attention_fn
        >>> attn = nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=functools.partial(
        ...     jd.nn.dot_product_attention, causal=True, context="ring"))
        >>> x = jnp.ones((2, 8, 16))
        >>> attn.apply(attn.init(jax.random.key(0), x), x).shape
        (2, 8, 16)
        >>> xla = jd.nn.dot_product_attention(q, k, v, causal=True, implementation="xla")  # forced
        >>> bool(jnp.allclose(out, xla, atol=1e-5))
        True
    """
    if flax_kwargs:
        raise TypeError(
            f"dot_product_attention got unexpected keyword argument(s) {sorted(flax_kwargs)}: it "
            "takes Flax's attention_fn arguments (mask, bias, dropout_rng, dropout_rate, "
            "broadcast_dropout, deterministic, dtype, precision, module, is_causal) and causal=, "
            "segment_ids=, context=, load_balance=.")
    if context is not None and context not in _MODES:
        raise ValueError(
            f"context={context!r} is not one of {_MODES}: 'all_gather' gathers keys/values along "
            "the context axes, 'ring' passes them around the ring of context devices (None: plain "
            "attention).")
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation={implementation!r} is not one of {IMPLEMENTATIONS}: 'cudnn' is "
            "cuDNN's fused attention (NVIDIA GPUs), 'xla' jax.nn.dot_product_attention's XLA one, "
            "'tokamax' tokamax's (the extra jaxdist[tokamax]), 'einsum' jaxdist's blockwise "
            "softmax (None: a fused kernel where one serves, the einsums elsewhere).")
    causal = bool(causal or is_causal)
    if load_balance and not causal:
        raise ValueError(
            "load_balance=True balances causal attention over the context devices (without a "
            "causal mask every device already does the same work): pass causal=True, or drop "
            "load_balance.")
    if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
        raise NotImplementedError(
            "qk_attn_weights_einsum / attn_weights_value_einsum are not supported by "
            "jd.nn.dot_product_attention: leave them unset (Flax's default).")
    del force_fp32_for_softmax, promote_dtype  # the softmax is in float32 already
    dtype = jnp.result_type(query, key, value) if dtype is None else dtype
    query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    dropout = dropout_rate > 0.0 and not deterministic

    policy = _context_policy()
    ring = policy is not None and context == "ring"
    split = policy is not None and context is not None
    impl = _implementation(implementation, query, key, dropout or module is not None, precision,
                           ring, split)
    with jax.named_scope(ATTENTION_SCOPE + impl):  # Plan.attention reads it from the program
        if policy is None or context is None:
            return _plain(query, key, value, bias, mask, causal, segment_ids, precision,
                          (dropout_rng, dropout_rate, broadcast_dropout) if dropout else None,
                          module, impl)
        if dropout or module is not None:
            raise NotImplementedError(
                "attention dropout and sown attention weights need the whole (L, L) weight matrix, "
                "which context parallelism never builds: pass deterministic=True (or "
                "dropout_rate=0.0) and no module to jd.nn.dot_product_attention on a context axis, "
                "or context=None for plain attention.")
        return _context_parallel(policy, query, key, value, bias, mask, causal, segment_ids,
                                 context, load_balance, precision, impl)


# --------------------------------------------------------------------------------------- the kernel
def _devices_platform() -> str:
    """``"cuda"`` for NVIDIA GPUs, else the platform of the devices the attention is traced for: the
    step's mesh inside a strategy's step (a plan's mesh without devices compiles on CPU), else JAX's
    default."""
    frame = ambient.current_computation()
    mesh = getattr(getattr(frame, "policy", None), "mesh", None)
    if mesh is not None and is_plan_mesh(mesh):
        return "cpu"
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    if device.platform in ("gpu", "cuda"):
        version = str(getattr(device.client, "platform_version", "")).lower()
        return "rocm" if "rocm" in version else "cuda"
    return device.platform


def _implementation(implementation: str | None, query: jax.Array, key: jax.Array,
                    weights_needed: bool, precision: Any, ring: bool, split: bool = False) -> str:
    """The kernel that computes the attention's blocks: ``implementation``, checked, or the
    backend's choice (cuDNN where `jax.nn.dot_product_attention` takes the case on every NVIDIA GPU:
    16-bit inputs, head_dim a multiple of 8 up to 128, even lengths, which its backward pass needs
    with a mask or bias). On context axes (``split``) the einsums by default: each device's block of
    queries may have an odd length, and the fused call over the gathered keys builds a whole
    (queries, keys) mask; ``implementation=`` forces a kernel."""
    if implementation is None:
        if ring or split or weights_needed or precision is not None:
            return "einsum"
        platform, head_dim = _devices_platform(), query.shape[-1]
        even = query.shape[-3] % 2 == 0 and key.shape[-3] % 2 == 0
        if (platform == "cuda" and query.dtype in _FUSED_DTYPES and head_dim % 8 == 0
                and head_dim <= 128 and even):
            return "cudnn"
        # jax has no fused attention of its own for TPUs
        if platform == "tpu" and _tokamax is not None:
            return "tokamax"
        return "einsum"
    if implementation == "cudnn" and (platform := _devices_platform()) != "cuda":
        raise ValueError(
            "implementation='cudnn' runs cuDNN's fused attention, on NVIDIA GPUs only; these "
            f"devices are {platform!r}: pass implementation=None (cuDNN on a GPU, the einsums "
            "here), 'xla' or 'einsum'.")
    if implementation == "tokamax" and _tokamax is None:
        raise ValueError(
            "implementation='tokamax' needs tokamax, which is not importable here: pip install "
            "'jaxdist[tokamax]' (or tokamax), or pass implementation=None, 'cudnn', 'xla' or "
            "'einsum'.")
    if implementation in _FUSED and weights_needed:
        raise NotImplementedError(
            f"implementation={implementation!r} is a fused kernel: it never builds the attention "
            "weights that dropout and sown weights (module=) need; pass implementation='einsum' "
            "(or None), or deterministic=True / dropout_rate=0.0 and no module.")
    if implementation in _FUSED and ring:
        raise NotImplementedError(
            f"implementation={implementation!r} cannot compute ring attention's steps: the ring "
            "combines each block's softmax statistics (log-sum-exp) and needs their gradient, "
            "which the fused kernels do not give. Pass context='all_gather' (one fused call over "
            "the gathered keys) or implementation='einsum' (or None) for the ring.")
    return implementation


def _fused(q, k, v, bias, vis, causal: bool, implementation: str):
    """Attention of the (already scaled) queries ``q (b, lq, h, d)`` by the fused
    ``implementation``: ``vis`` ``(b or 1, h or 1, lq, lk)`` bool (or None) where a query may
    attend, ``causal`` the kernel's own (top-left aligned) causal mask."""
    lq, lk = q.shape[1], k.shape[1]

    def full(x):  # the kernels take masks/biases of (batch or 1, heads or 1, lq, lk)
        return jnp.broadcast_to(x, (x.shape[0], x.shape[1], lq, lk))

    bias = None if bias is None else full(bias)
    if bias is not None and implementation == "cudnn":
        bias = bias.astype(q.dtype)  # cuDNN takes a bias of the inputs' dtype
    mask = None if vis is None else full(vis)
    if implementation == "tokamax":
        out = _tokamax.dot_product_attention(q, k, v, bias, mask, scale=1.0, is_causal=causal)
    else:
        out = jax.nn.dot_product_attention(q, k, v, bias, mask, scale=1.0, is_causal=causal,
                                           implementation=implementation)
    if mask is None and bias is None:
        return out
    # A query that may attend to nothing (masked everywhere, or a bias of -inf everywhere) gets
    # zeros, as the einsums give it (the kernels give the mean of the values, or NaN).
    seen = jnp.ones((1, 1, lq, lk), bool) if mask is None else mask
    if bias is not None:
        seen = seen & (bias > -jnp.inf)
    if causal:
        seen = seen & (jnp.arange(lq)[:, None] >= jnp.arange(lk)[None, :])
    alive = jnp.swapaxes(jnp.any(seen, -1), 1, 2)[..., None]  # (b or 1, lq, h or 1, 1)
    return jnp.where(alive, out, jnp.zeros((), out.dtype))


# ------------------------------------------------------------------------------------ the algorithm
def _context_policy() -> Any | None:
    """The layout policy of the strategy step being traced, when it has context axes of size > 1."""
    frame = ambient.current_computation()
    if frame is None or frame.kind != "global":
        return None
    policy = frame.policy
    if not getattr(policy, "context_axes", ()) or policy.context_size == 1:
        return None
    return policy


def _visible(q_pos, k_pos, q_seg, k_seg, mask, causal: bool):
    """Which (query, key) pairs may attend: ``(batch or 1, heads or 1, q, k)`` bool, or None."""
    vis = None
    if causal:
        vis = (q_pos[:, None] >= k_pos[None, :])[None, None]
    if q_seg is not None:
        same = (q_seg[:, :, None] == k_seg[:, None, :])[:, None]
        vis = same if vis is None else vis & same
    if mask is not None:
        vis = mask if vis is None else vis & mask
    return vis


def _block(carry, q, k, v, vis, bias, precision):
    """One online-softmax step: fold ``k``, ``v`` into the running ``(o, m, total)`` of ``q``:
    ``o`` ``(b, q, h, d)`` unnormalised output, ``m`` ``(b, h, q)`` running max (no gradient: the
    result does not depend on it), ``total`` ``(b, h, q)`` running sum, all float32 or wider."""
    o, m, total = carry
    acc = o.dtype
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=precision, preferred_element_type=acc)
    if bias is not None:
        s = s + bias.astype(acc)
    if vis is not None:
        s = jnp.where(vis, s, -jnp.inf)
    m_new = jnp.maximum(m, jax.lax.stop_gradient(s.max(-1)))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    correction = jnp.exp(m - m_safe)
    total = total * correction + p.sum(-1)
    pv = jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v, precision=precision,
                    preferred_element_type=acc)
    o = o * jnp.swapaxes(correction, 1, 2)[..., None] + pv
    return o, m_new, total


def _init_carry(q, v):
    """Zero output and sum, ``-inf`` max, for the queries ``q``. Built from ``q`` itself so that
    inside `jax.shard_map` they vary over the same mesh axes as the queries (a loop carry's type
    must not change)."""
    acc = jnp.promote_types(q.dtype, jnp.float32)
    zero = q[..., 0].astype(acc) * 0  # (b, q, h)
    o = zero[..., None] + jnp.zeros((v.shape[-1],), acc)
    per_row = jnp.swapaxes(zero, 1, 2)  # (b, h, q)
    return o, per_row - jnp.inf, per_row


def _finish(carry, dtype):
    o, _, total = carry
    total = jnp.swapaxes(total, 1, 2)[..., None]
    return jnp.where(total > 0, o / jnp.where(total > 0, total, 1.0), 0.0).astype(dtype)


def _as4(x: Any) -> Any:
    """A mask or bias as rank 4 ``(batch, heads, q, k)``: leading dimensions of size 1 added."""
    if x is None:
        return None
    x = jnp.asarray(x)
    if x.ndim > 4:
        raise ValueError(f"a mask/bias of shape {x.shape} has more than 4 dimensions (batch, "
                         "heads, q, k).")
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _plain(query, key, value, bias, mask, causal, segment_ids, precision, dropout, module,
           implementation):
    """Plain attention (one block of the same algorithm), any leading batch dimensions."""
    batch_shape = query.shape[:-3]
    lq, lk = query.shape[-3], key.shape[-3]
    flat = lambda x: x.reshape((-1, *x.shape[-3:]))  # noqa: E731
    q, k, v = flat(query), flat(key), flat(value)
    q = q / jnp.sqrt(q.shape[-1]).astype(q.dtype)

    # masks/biases over Flax's [batch..., heads, q, k]: batch dimensions flattened too
    def rank4(x):
        if x is None:
            return None
        x = jnp.asarray(x)
        x = x.reshape((1,) * max(0, len(batch_shape) + 3 - x.ndim) + x.shape)
        if batch_shape:
            x = jnp.broadcast_to(x, (*batch_shape, *x.shape[len(batch_shape):]))
        return x.reshape((-1, *x.shape[-3:]))

    seg = None if segment_ids is None else jnp.asarray(segment_ids).reshape(-1, lq)
    mask4 = None if mask is None else rank4(mask).astype(bool)
    if implementation != "einsum":  # the kernel's own causal mask (cuDNN skips the hidden blocks)
        out = _fused(q, k, v, rank4(bias), _visible(None, None, seg, seg, mask4, False), causal,
                     implementation)
        return out.astype(query.dtype).reshape((*batch_shape, *out.shape[1:]))
    vis = _visible(jnp.arange(lq), jnp.arange(lk), seg, seg, mask4, causal)
    bias4 = rank4(bias)
    if dropout is None and module is None:
        out = _finish(_block(_init_carry(q, v), q, k, v, vis, bias4, precision), query.dtype)
        return out.reshape((*batch_shape, *out.shape[1:]))
    # Dropout / sown weights need the normalised weights themselves (as Flax's).
    acc = jnp.promote_types(q.dtype, jnp.float32)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=precision, preferred_element_type=acc)
    if bias4 is not None:
        s = s + bias4.astype(acc)
    if vis is not None:
        s = jnp.where(vis, s, -jnp.inf)
    m = jax.lax.stop_gradient(s.max(-1, keepdims=True))
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    total = p.sum(-1, keepdims=True)
    weights = jnp.where(total > 0, p / jnp.where(total > 0, total, 1.0), 0.0)
    if module is not None:
        module.sow("intermediates", "attention_weights",
                   weights.reshape((*batch_shape, *weights.shape[1:])))
    if dropout is not None:
        rng, rate, broadcast = dropout
        shape = (weights.shape[0], 1, *weights.shape[2:]) if broadcast else weights.shape
        keep = jax.random.bernoulli(rng, 1.0 - rate, shape)
        weights = weights * keep.astype(weights.dtype) / (1.0 - rate)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), v,
                     precision=precision).astype(query.dtype)
    return out.reshape((*batch_shape, *out.shape[1:]))


# --------------------------------------------------------------------- context parallel (shard_map)
def _check(policy, query, key, value, load_balance: bool) -> None:
    n = policy.context_size
    axes = policy.context_axes
    sizes = {a: policy.mesh.shape[a] for a in axes}
    for name, x in (("query", query), ("key", key), ("value", value)):
        if np.ndim(x) != 4:
            raise ValueError(
                f"{name} has shape {tuple(np.shape(x))}: on context axes {axes} "
                "jd.nn.dot_product_attention takes Flax's (batch, length, heads, head_dim) layout; "
                "reshape extra batch dimensions into the first.")
    if query.shape[1] != key.shape[1]:
        raise ValueError(
            f"query length {query.shape[1]} != key length {key.shape[1]}: on context axes {axes} "
            "the sequence of queries and keys is the same split sequence (self-attention); pass "
            "context=None for attention over another sequence (XLA gathers it).")
    length = query.shape[1]
    parts = 2 * n if load_balance else n
    if length % parts:
        why = f" (2 x {n} zig-zag chunks for load_balance=True)" if parts != n else ""
        raise ValueError(
            f"sequence length {length} is not divisible by {parts}{why}: the context axes {axes} "
            f"of sizes {sizes} split it into {n} parts. Pad the sequence to "
            f"{-(-length // parts) * parts} (a multiple of {parts}), or pick context axes whose "
            f"size divides {length}.")


def _spec_entry(entry: Any, drop: set[str]) -> Any:
    names = tuple(n for n in entry_axes(entry) if n not in drop)
    return None if not names else names[0] if len(names) == 1 else names


def _context_parallel(policy, query, key, value, bias, mask, causal, segment_ids, context,
                      load_balance, precision, implementation):
    _check(policy, query, key, value, load_balance)
    axes = tuple(policy.context_axes)
    entry = axes[0] if len(axes) == 1 else axes
    n = policy.context_size
    mesh = trace_mesh(policy.mesh)  # Auto where the step runs the mesh's Explicit axes Auto
    explicit = set(explicit_axes(policy.mesh))
    zigzag = load_balance
    q = query / jnp.sqrt(query.shape[-1]).astype(query.dtype)
    mask4 = None if mask is None else _as4(mask).astype(bool)
    bias4 = _as4(bias)
    seg = None if segment_ids is None else jnp.asarray(segment_ids)
    length = query.shape[1]

    # Which operands are split along the sequence (the rest are whole on every context device).
    operands, dims = [q, key, value], [1, 1, 1]
    if seg is not None:
        operands, dims = [*operands, seg], [*dims, 1]
    for extra in (mask4, bias4):
        if extra is not None:
            operands.append(extra)
            dims.append(2 if extra.shape[2] == length and extra.shape[2] > 1 else None)

    if explicit:
        # Sharding in types: shard_map over every axis, the other axes as the operands' types say;
        # the query's type decides every operand's batch and head layout (they must broadcast).
        typed = getattr(getattr(jax.typeof(q), "sharding", None), "spec", None) or ()
        batch_e, head_e = (_spec_entry(e, set(axes)) for e in (*typed, None, None, None)[0:3:2])
        b, h = query.shape[0], query.shape[2]
        specs = []
        for i, (x, dim) in enumerate(zip(operands, dims, strict=True)):
            spec = [None] * x.ndim
            spec[0] = batch_e if x.shape[0] == b else None
            if i < 3:  # query, key, value: (batch, length, heads, dim)
                spec[2] = head_e if x.shape[2] == h else None
            elif x.ndim == 4:  # mask, bias: (batch, heads, q, k)
                spec[1] = head_e if x.shape[1] == h else None
            if dim is not None:
                spec[dim] = entry
            specs.append(PartitionSpec(*spec))
        operands = [jax.sharding.reshard(x, s) for x, s in zip(operands, specs, strict=True)]
        manual = None
    else:
        specs = [PartitionSpec() if d is None else PartitionSpec(*([None] * d), entry)
                 for d in dims]
        manual = frozenset(axes)
    out_spec = (PartitionSpec(specs[0][0], entry, specs[0][2], specs[2][3]) if explicit
                else PartitionSpec(None, entry))

    has_seg, has_mask, has_bias = seg is not None, mask4 is not None, bias4 is not None
    mask_rows = mask4 is not None and dims[3 + has_seg] is not None
    bias_rows = bias4 is not None and dims[3 + has_seg + has_mask] is not None

    def local(*xs):
        q, k, v, *rest = xs
        s = rest.pop(0) if has_seg else None
        mk = rest.pop(0) if has_mask else None
        bs = rest.pop(0) if has_bias else None
        if zigzag:
            q, k, v = (_zigzag(x, 1, axes, n) for x in (q, k, v))
            s = None if s is None else _zigzag(s, 1, axes, n)
            mk = _zigzag(mk, 2, axes, n) if mask_rows else mk
            bs = _zigzag(bs, 2, axes, n) if bias_rows else bs
        if implementation != "einsum":  # all-gather only (`_implementation` refuses the ring)
            out = _all_gather_fused(q, k, v, s, mk, bs, causal=causal, axes=axes, n=n,
                                    length=length, zigzag=zigzag, implementation=implementation)
        else:
            algorithm = _ring if context == "ring" else _all_gather
            out = algorithm(q, k, v, s, mk, bs, causal=causal, axes=axes, n=n, length=length,
                            zigzag=zigzag, precision=precision)
        if zigzag:
            out = _unzigzag(out, 1, axes, n)
        return out

    kwargs = {} if manual is None else {"axis_names": manual}
    fn = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=out_spec, **kwargs)
    return fn(*operands).astype(query.dtype)


def _columns(x, positions, lc_total: int):
    """The key columns ``positions`` of a mask/bias block (whole along the key axis); size-1 axes
    broadcast."""
    if x is None or x.shape[-1] == 1:
        return x
    return jnp.take(x, positions, axis=-1) if x.shape[-1] == lc_total else x


def _part(x, axis: int, part: slice, size: int):
    """``x[..., part]`` along ``axis`` of a mask/bias block where that axis is ``size`` long (a
    size-1 axis broadcasts)."""
    return x if x is None or x.shape[axis] != size else x[(slice(None),) * axis + (part,)]


def _folder(q, v, seg, mask, bias, *, axes, causal, n, length, zigzag, precision):
    """The blockwise online softmax of the local queries ``q``: ``(carries, update)``, where
    ``update(carries, (k, v, k_seg), src)`` folds in the K/V block context device ``src`` holds.

    The queries and keys are two chunks each (with ``zigzag``, the two zig-zag chunks); a chunk pair
    that the causal mask hides entirely is skipped (`jax.lax.cond`), so the work of a device is what
    its positions need. Each chunk pair is rematerialised in the backward pass (`jax.checkpoint`):
    memory stays one block per device.
    """
    idx = jax.lax.axis_index(axes)
    lc = q.shape[1]
    # Two query and two key chunks per block (the zig-zag halves when load balancing): score blocks
    # of (L / 2N)^2, and causal visibility decided per chunk pair.
    chunks = 2 if lc % 2 == 0 else 1
    cl = lc // chunks
    q_pos = _positions(idx, n, lc, zigzag)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def fold(carry, qc, qp, qs, kc, vc, kp, ks, mc, bc):
        return _block(carry, qc, kc, vc, _visible(qp, kp, qs, ks, mc, causal), bc, precision)

    def update(carries, kv, src):
        kb, vb, kseg = kv
        k_pos = _positions(src, n, lc, zigzag)
        mcols = _columns(mask, k_pos, length)
        bcols = _columns(bias, k_pos, length)
        new = []
        for i, carry in enumerate(carries):
            rows = slice(i * cl, (i + 1) * cl)
            qc, qp = q[:, rows], q_pos[rows]
            qs = None if seg is None else seg[:, rows]
            mrows, brows = _part(mcols, 2, rows, lc), _part(bcols, 2, rows, lc)
            for j in range(chunks):
                cols = slice(j * cl, (j + 1) * cl)
                kc, vc, kp = kb[:, cols], vb[:, cols], k_pos[cols]
                ks = None if kseg is None else kseg[:, cols]
                mc, bc = _part(mrows, 3, cols, lc), _part(brows, 3, cols, lc)
                args = (qc, qp, qs, kc, vc, kp, ks, mc, bc)
                if causal:  # a chunk pair the causal mask hides entirely costs nothing
                    carry = jax.lax.cond(qp[-1] >= kp[0], lambda c, a: fold(c, *a), lambda c, a: c,
                                         carry, args)
                else:
                    carry = fold(carry, *args)
            new.append(carry)
        return new

    return [_init_carry(q[:, i * cl:(i + 1) * cl], v) for i in range(chunks)], update


def _finish_all(carries, dtype):
    return jnp.concatenate([_finish(c, dtype) for c in carries], axis=1)


def _all_gather(q, k, v, seg, mask, bias, *, causal, axes, n, length, zigzag, precision):
    """Gather K/V (and key segments) along the context axes, then fold them in block by block."""
    carries, update = _folder(q, v, seg, mask, bias, axes=axes, causal=causal, n=n, length=length,
                              zigzag=zigzag, precision=precision)
    lc = k.shape[1]
    gathered = [
        None if x is None else jax.lax.all_gather(x, axes, axis=1, tiled=True) for x in (k, v, seg)
    ]

    def step(carries, src):
        kv = [None if x is None else jax.lax.dynamic_slice_in_dim(x, src * lc, lc, axis=1)
              for x in gathered]
        return update(carries, kv, src), None

    carries, _ = jax.lax.scan(step, carries, jnp.arange(n), unroll=n <= _UNROLL)
    return _finish_all(carries, q.dtype)


def _all_gather_fused(q, k, v, seg, mask, bias, *, causal, axes, n, length, zigzag, implementation):
    """Gather K/V (and key segments) along the context axes, then attend to them in one fused-kernel
    call, the causal mask (from local and gathered token positions) part of its ``(q, L)`` mask."""
    lc = q.shape[1]
    q_pos = _positions(jax.lax.axis_index(axes), n, lc, zigzag)
    k_pos = jnp.concatenate([_positions(src, n, lc, zigzag) for src in range(n)])  # gathered order
    kg, vg, sg = (None if x is None else jax.lax.all_gather(x, axes, axis=1, tiled=True)
                  for x in (k, v, seg))
    vis = _visible(q_pos, k_pos, seg, sg, _columns(mask, k_pos, length), causal)
    return _fused(q, kg, vg, _columns(bias, k_pos, length), vis, False, implementation)


def _ring(q, k, v, seg, mask, bias, *, causal, axes, n, length, zigzag, precision):
    """Pass K/V blocks around the ring of context devices, folding in each as it arrives."""
    carries, update = _folder(q, v, seg, mask, bias, axes=axes, causal=causal, n=n, length=length,
                              zigzag=zigzag, precision=precision)
    idx = jax.lax.axis_index(axes)
    perm = [(i, (i + 1) % n) for i in range(n)]

    def step(state, s):
        carries, kv = state
        nxt = jax.tree.map(lambda x: jax.lax.ppermute(x, axes, perm), kv)  # overlaps the compute
        carries = update(carries, kv, (idx - s) % n)
        return (carries, nxt), None

    kv = (k, v, seg)
    if n > 1:
        # Unrolled up to 8 steps: XLA schedules each transfer against the previous block's compute,
        # and cost analysis (FLOPs, MFU) counts every block.
        (carries, kv), _ = jax.lax.scan(step, (carries, kv), jnp.arange(n - 1),
                                        unroll=n - 1 <= _UNROLL)
    carries = update(carries, kv, (idx - (n - 1)) % n)
    return _finish_all(carries, q.dtype)
