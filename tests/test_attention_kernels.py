"""`jd.nn.dot_product_attention`'s kernels: every implementation that runs on CPU equals the
einsums.

``implementation="xla"`` (`jax.nn.dot_product_attention`'s XLA kernel), ``"tokamax"`` (where the
optional extra is installed: its XLA implementation on CPU) and ``"einsum"`` (jaxdist's blockwise
online softmax) are forced on the same inputs and compared in values and gradients (float32):
causal, padding masks, packed segments and biases; off a context axis, and on the context axes'
all-gather (one fused call over the gathered keys) and ring (the einsums). cuDNN cannot run here:
its path is lowered for CUDA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import PartitionSpec as P

import jaxdist as jd
from jaxdist.nn import attention, optional

pytestmark = pytest.mark.timeout(300)

AUTO = jax.sharding.AxisType.Auto
B, L, H, D = 4, 32, 2, 8
TOKAMAX = pytest.param("tokamax", marks=pytest.mark.skipif(
    optional.tokamax is None,
    reason="tokamax (the optional extra jaxdist[tokamax]) is not installed"))


def _inputs(seed=0, length=L):
    rng = np.random.default_rng(seed)
    q, k, v, ct = (rng.normal(size=(B, length, H, D)).astype(np.float32) for _ in range(4))
    # padding
    valid = np.arange(length)[None, :] < np.array([length, length - 5, length // 2, 3])[:, None]
    # packed
    segments = (np.arange(length)[None, :] >= np.array([0, 7, 16, 25])[:, None]).astype(np.int32)
    bias = rng.normal(size=(1, H, length, length)).astype(np.float32)
    return q, k, v, ct, valid, segments, bias


CASES = {  # id: keyword arguments, built from (valid, segments, bias) inside the step
    "causal": lambda valid, seg, bias: {"causal": True},
    "padding": lambda valid, seg, bias: {"mask": valid[:, None, :, None] & valid[:, None, None, :]},
    "causal_padding": lambda valid, seg, bias: {"causal": True, "mask": valid[:, None, None, :]},
    "segments": lambda valid, seg, bias: {"causal": True, "segment_ids": seg},
    "bias": lambda valid, seg, bias: {"bias": bias, "mask": valid[:, None, None, :]},
}


def _value_and_grads(impl, case, **kwargs):
    """The attention's output and the gradients of ``sum(out * ct)`` with respect to q, k and v."""

    def step(q, k, v, ct, valid, seg, bias):
        extra = CASES[case](valid, seg, bias)

        def f(q, k, v):
            return jd.nn.dot_product_attention(q, k, v, implementation=impl, **extra, **kwargs)

        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(ct)

    return step


def _close(got, want, atol=2e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=atol)


@pytest.mark.parametrize("impl", ["xla", None, TOKAMAX])
@pytest.mark.parametrize("case", list(CASES))
def test_every_cpu_implementation_equals_the_einsums_in_values_and_gradients(case, impl):
    args = _inputs()
    want = jax.jit(_value_and_grads("einsum", case))(*args)
    got = jax.jit(_value_and_grads(impl, case))(*args)
    _close(got, want)
    # a query that may attend to nothing (a padding position) gets zeros, every kernel
    if case == "padding":
        out = np.asarray(got[0])
        assert np.all(out[3, 3:] == 0) and np.any(out[3, :3] != 0)


def test_leading_batch_dimensions_and_bfloat16_through_the_xla_kernel():
    q, k, v, *_ = _inputs()
    q5, k5, v5 = (jnp.asarray(x).reshape(2, 2, L, H, D) for x in (q, k, v))
    for dtype, atol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
        got = jd.nn.dot_product_attention(q5, k5, v5, causal=True, implementation="xla",
                                          dtype=dtype)
        want = jd.nn.dot_product_attention(q5, k5, v5, causal=True, implementation="einsum",
                                           dtype=dtype)
        assert got.dtype == dtype and got.shape == (2, 2, L, H, D)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   atol=atol)


def _cp_strategy(kind):
    if kind == "data2_context4":
        mesh = jax.make_mesh((2, 4), ("data", "context"))  # Explicit axes (jax.make_mesh's default)
        return jd.ShardedStrategy(mesh=mesh, batch_axes="data", context_axes="context",
                                  min_shard_size=1)
    mesh = jax.make_mesh((4,), ("context",), axis_types=(AUTO,), devices=jax.devices()[:4])
    return jd.ShardedStrategy(mesh=mesh, batch_axes=(), context_axes="context", min_shard_size=1)


# (context, load_balance, implementation): the ring runs the einsums whatever the backend (see the
# module doc).
EINSUMS = [("all_gather", False, "einsum"), ("ring", True, None), ("ring", False, "einsum")]


@pytest.mark.parametrize("fused", ["xla", TOKAMAX])
@pytest.mark.parametrize("case", ["causal_padding", "segments", "bias"])
@pytest.mark.parametrize("kind", ["data2_context4", "context4"])
def test_context_parallel_kernels_equal_the_einsums_on_one_device(kind, case, fused):
    args = _inputs(1)
    want = jax.jit(_value_and_grads("einsum", case))(*args)
    strategy = _cp_strategy(kind)
    # The einsum paths on one mesh (the context parallelism tests run them on others and in models).
    runs = [("all_gather", False, fused), ("all_gather", True, fused)] + (
        EINSUMS if fused == "xla" and kind == "context4" else [])
    for context, balance, impl in runs:
        if balance and not CASES[case](*args[4:]).get("causal"):
            continue
        step = strategy.jit(_value_and_grads(impl, case, context=context, load_balance=balance),
                            batch_argnums=(0, 1, 2, 3, 4, 5))
        _close(jax.device_get(step(*args)), want)


def test_the_plan_names_the_kernel():
    strategy = _cp_strategy("data2_context4")
    args = _inputs()
    for impl, context, kernel in (("xla", "all_gather", "xla"), (None, "ring", "einsum"),
                                  (None, None, "einsum")):
        step = strategy.jit(
            _value_and_grads(impl, "causal", context=context), batch_argnums=(0, 1, 2, 3, 4, 5)
        )
        plan = step.plan(*args)
        assert plan.attention == (kernel,), (impl, context, plan.attention)
        assert f"Attention: {kernel}" in str(plan)
    assert jd.OneDeviceStrategy().jit(lambda x: x + 1).plan(np.ones(2, np.float32)).attention == ()


def test_bad_implementations_are_errors_naming_the_argument_and_the_fix(monkeypatch):
    q, k, v, *_ = _inputs()
    with pytest.raises(ValueError,
                                         match=r"implementation='flash' is not one of \('einsum', "
                                               r"'xla', 'cudnn', "
                                         r"'tokamax'\)"):
        jd.nn.dot_product_attention(q, k, v, implementation="flash")
    with pytest.raises(
        ValueError,
        match=r"implementation='cudnn' runs cuDNN's fused "
        r"attention, on NVIDIA GPUs "
        r"only; these devices are 'cpu': pass implementation=None",
    ):
        jd.nn.dot_product_attention(q, k, v, implementation="cudnn")
    with pytest.raises(NotImplementedError,
                                                  match=r"implementation='xla' is a fused kernel: "
                                                        r"it never builds the "
                                                  r"attention weights that dropout"):
        jd.nn.dot_product_attention(q, k, v, implementation="xla", dropout_rate=0.1,
                                    dropout_rng=jax.random.key(0))
    step = _cp_strategy("context4").jit(
        lambda q, k, v: jd.nn.dot_product_attention(q, k, v, context="ring", implementation="xla"),
        batch_argnums=(0, 1, 2))
    with pytest.raises(NotImplementedError,
                                                  match=r"implementation='xla' cannot compute ring "
                                                        r"attention's steps.*"
                                                  r"Pass context='all_gather'"):
        step(q, k, v)
    monkeypatch.setattr(attention, "_tokamax", None)
    with pytest.raises(ValueError,
                                         match=r"implementation='tokamax' needs tokamax, which is "
                                               r"not importable here: "
                                         r"pip install 'jaxdist\[tokamax\]'"):
        jd.nn.dot_product_attention(q, k, v, implementation="tokamax")


def test_the_default_kernel_by_backend(monkeypatch):
    # None: cuDNN on an NVIDIA GPU (16-bit, head_dim a multiple of 8 up to 128, even lengths),
    # tokamax on a TPU where it is installed, the einsums elsewhere and wherever a fused kernel
    # cannot serve (ring, dropout, precision).
    bf16 = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)

    def choose(impl, q, *rest):
        return attention._implementation(impl, q, q, *rest)

    for platform, tokamax, want in (("cuda", None, "cudnn"), ("tpu", object(), "tokamax"),
                                    ("tpu", None, "einsum"),
                                    ("rocm", object(), "einsum"), ("cpu", object(), "einsum")):
        monkeypatch.setattr(attention, "_devices_platform", lambda p=platform: p)
        monkeypatch.setattr(attention, "_tokamax", tokamax)
        assert choose(None, bf16, False, None, False) == want, (platform, tokamax)
    monkeypatch.setattr(attention, "_devices_platform", lambda: "cuda")
    # cuDNN: 16-bit only
    assert choose(None, bf16.astype(jnp.float32), False, None, False) == "einsum"
    assert choose(None, jnp.zeros((1, 8, 2, 256), jnp.bfloat16), False, None, False) == "einsum"
    # odd length
    assert choose(None, jnp.zeros((1, 7, 2, 64), jnp.bfloat16), False, None, False) == "einsum"
    assert choose(None, bf16, True, None, False) == "einsum"  # dropout / sown weights
    assert choose(None, bf16, False, jax.lax.Precision.HIGHEST, False) == "einsum"
    assert choose(None, bf16, False, None, True) == "einsum"  # the ring
    # context axes (blocks of any length)
    assert choose(None, bf16, False, None, False, True) == "einsum"
    assert choose("cudnn", bf16, False, None, False, True) == "cudnn"  # forced: as asked


def test_a_query_whose_bias_is_minus_infinity_everywhere_gets_zeros_as_with_the_einsums():
    q = jax.random.normal(jax.random.key(0), (1, 4, 2, 8))
    bias = jnp.zeros((1, 2, 4, 4)).at[:, :, 1, :].set(-jnp.inf)  # query 1 may attend to nothing
    einsum = jd.nn.dot_product_attention(q, q, q, bias=bias, implementation="einsum")
    xla = jd.nn.dot_product_attention(q, q, q, bias=bias, implementation="xla")
    assert np.isfinite(np.asarray(xla)).all()
    np.testing.assert_allclose(xla, einsum, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(xla[:, 1], 0.0)


def test_a_plan_mesh_compiles_on_cpu_so_cudnn_is_refused_and_auto_is_the_einsums():
    strategy = jd.ShardedStrategy(mesh=jd.plan_mesh({"data": 2, "context": 4}), batch_axes="data",
                                  context_axes="context", min_shard_size=1)
    q, k, v, *_ = (x.astype(jnp.bfloat16) for x in _inputs())
    plan = strategy.jit(lambda q, k, v: jd.nn.dot_product_attention(q, k, v, causal=True),
                        batch_argnums=(0, 1, 2)).plan(q, k, v)
    assert plan.attention == ("einsum",)
    with pytest.raises(ValueError, match=r"these devices are 'cpu'"):
        strategy.jit(lambda q, k, v: jd.nn.dot_product_attention(q, k, v, implementation="cudnn"),
                     batch_argnums=(0, 1, 2)).plan(q, k, v)


# -------------------------------------------------------------------------- cuDNN, lowered for CUDA
@pytest.fixture
def as_on_a_gpu(monkeypatch):
    """Trace as on an NVIDIA GPU: the devices' platform read as CUDA, and jax's cuDNN version check
    (which needs the CUDA libraries, absent here: "cuDNN is not detected") answering 9.10."""
    from jax._src.cudnn import fused_attention_stablehlo

    monkeypatch.setattr(attention, "_devices_platform", lambda: "cuda")
    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)


CUDNN_CHECKS = [export.DisabledSafetyCheck.custom_call(f"__cudnn$fmha{kind}")
                for kind in ("Softmax", "SoftmaxBackward", "ScaleBiasSoftmax",
                             "ScaleBiasSoftmaxBackward")]


def test_cudnn_attention_lowers_for_cuda_and_is_the_gpu_default(as_on_a_gpu):
    q, k, v, _, valid, *_ = (jnp.asarray(x) for x in _inputs())
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))

    def loss(q, k, v, valid, **kwargs):
        out = jd.nn.dot_product_attention(q, k, v, causal=True, **kwargs)
        padded = jd.nn.dot_product_attention(q, k, v, mask=valid[:, None, None, :], causal=True,
                                             **kwargs)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(padded.astype(jnp.float32))

    exported = export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=("cuda",),
                             # implementation=None: the default
                             disabled_checks=CUDNN_CHECKS)(q, k, v, valid)
    module = exported.mlir_module()
    assert (module.count("@__cudnn$fmhaSoftmax(") == 1
            and module.count("@__cudnn$fmhaSoftmaxBackward(") == 1)
    assert module.count("@__cudnn$fmhaScaleBiasSoftmax(") == 1  # the padding mask, as cuDNN's bias
    assert "jaxdist_attention_cudnn" in module  # the named scope plans read the kernel from


def test_cudnn_all_gather_attention_lowers_for_cuda(as_on_a_gpu):
    # The context axes' all-gather path with the cuDNN kernel (load balanced, causal, packed
    # segments), the gradients included, inside the shard_map a strategy's step runs it in.
    q, k, v, _, _, seg, _ = (jnp.asarray(x) for x in _inputs())
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    mesh = jax.make_mesh((2, 4), ("data", "context"), axis_types=(AUTO,) * 2)

    def local(q, k, v, seg):
        return attention._all_gather_fused(q, k, v, seg, None, None, causal=True, axes=("context",),
                                           n=4, length=L, zigzag=True, implementation="cudnn")

    def loss(q, k, v, seg):
        spec = P("data", "context")
        out = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)(q, k, v, seg)
        return jnp.sum(out.astype(jnp.float32))

    exported = export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=("cuda",),
                             disabled_checks=CUDNN_CHECKS)(q, k, v, seg)
    module = exported.mlir_module()
    assert module.count("@__cudnn$fmhaScaleBiasSoftmax(") == 1, module.count("@__cudnn$fmha")
    assert module.count("@__cudnn$fmhaScaleBiasSoftmaxBackward(") == 1
    assert "all_gather" in module and "reduce_scatter" in module
