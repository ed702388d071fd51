"""Code shaped like Flax's gemma example, through jaxdist: sharding in types on the user's own mesh.

The program below is a tiny decoder written the way the gemma example writes its model and its
training step (same signatures, same Flax and JAX calls, nothing distributed in the step functions):

* a mesh from `jax.make_mesh` (Explicit axes, JAX's default) named ("fsdp", "tensor");
* a sharding config whose specs annotate the weights through nnx Variable metadata
  (``out_sharding``) AND the activations through ``out_sharding=`` on every projection;
* model and ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` created under ``jax.set_mesh(mesh)``;
* two step functions: ``nnx_train_step`` updates model, optimizer, rngs and metrics in place
  (``nnx.value_and_grad``); ``jax_train_step`` differentiates ``nnx.split(model, nnx.Param, ...)``
  with ``jax.value_and_grad`` and returns ``nnx.state((model, optimizer, rngs, metrics))`` for the
  caller's ``nnx.update``; both jitted with ``static_argnames=("label_smoothing", "pad_id")`` and
  ``donate_argnames=("model", "optimizer")``, called positionally on batches placed
  ``NamedSharding(mesh, P("fsdp"))``.

Reference: the same program with no mesh and no annotations, on one device. Plain ``jax.jit`` /
``nnx.jit`` on the 4x2 mesh must equal it (that shows the program is right); so must
``ShardedStrategy(mesh=mesh, batch_axes=("fsdp",)).jit``, with every parameter and optimizer-state
array kept in the layout the program annotated, after every step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist as jd

pytestmark = pytest.mark.timeout(240)

RTOL, ATOL = 1e-5, 1e-6
STEPS = 3
BATCH, SEQ, VOCAB = 8, 8, 32
EMBED, HIDDEN, HEADS, HEAD_DIM, LAYERS = 16, 32, 2, 8, 2
PAD = 0


# ==================================================================================================
# The program (a gemma-shaped decoder; no jaxdist in it).
# ==================================================================================================
@dataclasses.dataclass(frozen=True)
class Specs:
    """Where weights and activations live. B: batch, T: time, D: embed, F: hidden, N: heads, H: head
    dim."""

    embed_vd: P | None = None
    qkv_sndh: P | None = None
    out_ndh: P | None = None  # N, H -> D projection
    mlp_df: P | None = None
    mlp_fd: P | None = None
    norm_d: P | None = None
    act_btd: P | None = None
    act_btf: P | None = None
    act_sbtnh: P | None = None

    @staticmethod
    def unannotated() -> Specs:
        return Specs()

    @staticmethod
    def fsdp_and_tensor(fsdp: str = "fsdp", tensor: str = "tensor") -> Specs:
        # Weights: one dimension over the fsdp axis (ZeRO-3), another over the tensor axis
        # (Megatron-style heads / hidden units). Activations: batch over fsdp, heads / hidden /
        # embed over tensor.
        return Specs(
            embed_vd=P(tensor, fsdp),
            qkv_sndh=P(None, tensor, fsdp, None),
            out_ndh=P(tensor, None, fsdp),
            mlp_df=P(fsdp, tensor),
            mlp_fd=P(tensor, fsdp),
            norm_d=P(tensor),
            act_btd=P(fsdp, None, tensor),
            act_btf=P(fsdp, None, tensor),
            act_sbtnh=P(None, fsdp, None, tensor, None),
        )


class Norm(nnx.Module):
    """Root-mean-square normalisation with a learned (1 + scale) gain."""

    def __init__(self, dim: int, specs: Specs, *, rngs: nnx.Rngs):
        self.scale = nnx.Param(jnp.zeros((dim,), jnp.float32), out_sharding=specs.norm_d)

    def __call__(self, x):
        inv_rms = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        return x * inv_rms * (1.0 + self.scale[...])


class Embedder(nnx.Embed):
    """Token embedding scaled by sqrt(D); ``attend`` (inherited) gives the tied output logits."""

    def __call__(self, tokens, out_sharding=None):
        return super().__call__(tokens, out_sharding) * jnp.sqrt(float(self.features))


def rotate(x, positions):
    """Rotary position encoding of x (B, T, N, H) at integer positions (B, T)."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10_000.0 ** (jnp.arange(half) / half))
    angle = (positions[..., None] * freq)[..., None, :]  # (B, T, 1, H/2)
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * jnp.cos(angle) - b * jnp.sin(angle),
                            b * jnp.cos(angle) + a * jnp.sin(angle)], -1)


class SelfAttention(nnx.Module):
    def __init__(self, specs: Specs, *, rngs: nnx.Rngs):
        self.specs = specs
        self.qkv = nnx.Einsum(
            "BTD,SNDH->SBTNH", (3, HEADS, EMBED, HEAD_DIM),
            kernel_metadata={"out_sharding": specs.qkv_sndh}, rngs=rngs
        )
        self.out = nnx.Einsum(
            "BTNH,NHD->BTD", (HEADS, HEAD_DIM, EMBED),
            kernel_metadata={"out_sharding": specs.out_ndh}, rngs=rngs
        )

    def __call__(self, x, positions, mask):
        q, k, v = self.qkv(x, out_sharding=self.specs.act_sbtnh)
        q, k = rotate(q, positions) * HEAD_DIM**-0.5, rotate(k, positions)
        scores = jnp.einsum("BTNH,BSNH->BTNS", q, k)
        scores = jnp.where(mask[:, :, None, :], scores, -1e30)  # mask: (B, T, S)
        mixed = jnp.einsum("BTNS,BSNH->BTNH", jax.nn.softmax(scores, axis=-1), v)
        return self.out(mixed, out_sharding=self.specs.act_btd)


class GatedMLP(nnx.Module):
    def __init__(self, specs: Specs, *, rngs: nnx.Rngs):
        self.specs = specs

        def linear(i, o, spec):
            return nnx.Linear(i, o, use_bias=False, kernel_metadata={"out_sharding": spec},
                              rngs=rngs)

        self.gate, self.up = (linear(EMBED, HIDDEN, specs.mlp_df),
                              linear(EMBED, HIDDEN, specs.mlp_df))
        self.down = linear(HIDDEN, EMBED, specs.mlp_fd)

    def __call__(self, x):
        hidden = nnx.gelu(self.gate(x, out_sharding=self.specs.act_btf)) * self.up(
            x, out_sharding=self.specs.act_btf
        )
        return self.down(hidden, out_sharding=self.specs.act_btd)


class Block(nnx.Module):
    def __init__(self, specs: Specs, *, rngs: nnx.Rngs):
        self.attn_norm, self.attn = Norm(EMBED, specs, rngs=rngs), SelfAttention(specs, rngs=rngs)
        self.mlp_norm, self.mlp = Norm(EMBED, specs, rngs=rngs), GatedMLP(specs, rngs=rngs)

    def __call__(self, x, positions, mask):
        x = x + self.attn(self.attn_norm(x), positions, mask)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nnx.Module):
    def __init__(self, specs: Specs, *, rngs: nnx.Rngs):
        self.specs = specs
        self.embedder = Embedder(VOCAB, EMBED, embedding_metadata={"out_sharding": specs.embed_vd},
                                 rngs=rngs)
        self.blocks = nnx.List([Block(specs, rngs=rngs) for _ in range(LAYERS)])
        self.final_norm = Norm(EMBED, specs, rngs=rngs)
        # the example's default rate: takes rngs, draws none
        self.dropout = nnx.Dropout(0.0, deterministic=False)

    def __call__(self, tokens, positions, mask, rngs=None):
        x = self.embedder(tokens, out_sharding=self.specs.act_btd)
        for block in self.blocks:
            x = block(x, positions, mask)
        x = self.dropout(self.final_norm(x), rngs=rngs)
        return self.embedder.attend(x, out_sharding=self.specs.act_btd)  # tied logits (B, T, V)


def causal_mask(keep):
    """(B, T) token mask -> (B, T, S): attend to earlier, non-padded tokens."""
    return keep[:, None, :] & jnp.tril(jnp.ones((keep.shape[-1],) * 2, bool))[None]


def per_sample_loss(logits, targets, weights, label_smoothing):
    """Label-smoothed cross entropy, summed over time and normalised by the batch's token count."""
    on = 1.0 - label_smoothing
    off = label_smoothing / (VOCAB - 1)
    soft = jax.nn.one_hot(targets, VOCAB) * (on - off) + off
    token_loss = -jnp.sum(soft * nnx.log_softmax(logits), axis=-1) * weights
    return token_loss.sum(axis=1) * targets.shape[0] / weights.sum()


def _unpack(batch, pad_id):
    keep = batch["inputs"] > pad_id
    same_segment = (
        batch["inputs_segmentation"][:, :, None] == batch["inputs_segmentation"][:, None, :]
    )
    return keep, causal_mask(keep) & same_segment


def nnx_train_step(model, optimizer, rngs, batch, train_metrics, label_smoothing=0.0, pad_id=0):
    """One step, everything updated in place (the example's ``nnx_train_step`` shape)."""
    keep, mask = _unpack(batch, pad_id)

    def loss_fn(model, rngs):
        logits = model(batch["inputs"], batch["inputs_position"], mask, rngs=rngs)
        losses = per_sample_loss(logits, batch["targets"], keep.astype(jnp.float32),
                                 label_smoothing)
        return losses.mean(), (losses, logits)

    (_, (losses, logits)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, rngs.fork())
    optimizer.update(model, grads)
    train_metrics.update(loss=losses, logits=logits, labels=batch["targets"],
                         mask={"accuracy": keep})


def jax_train_step(model, optimizer, rngs, batch, train_metrics, label_smoothing=0.0, pad_id=0):
    """One step through ``jax.value_and_grad`` over the split parameters; returns the new state (the
    example's ``jax_train_step`` shape: ``(nnx.state(...), intermediates)``)."""
    keep, mask = _unpack(batch, pad_id)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, rngs):
        module = nnx.merge(graphdef, params, rest)
        logits = module(batch["inputs"], batch["inputs_position"], mask, rngs=rngs)
        losses = per_sample_loss(logits, batch["targets"], keep.astype(jnp.float32),
                                 label_smoothing)
        return losses.mean(), (losses, logits)

    (_, (losses, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rngs.fork())
    optimizer.update(model, grads)
    train_metrics.update(loss=losses, logits=logits, labels=batch["targets"],
                         mask={"accuracy": keep})
    return nnx.state((model, optimizer, rngs, train_metrics)), None


STEP_FNS = {"nnx": nnx_train_step, "jax": jax_train_step}


def build(specs: Specs):
    """Model, optimizer, rngs and metrics as the example builds them (the caller provides the mesh
    context)."""
    rngs = nnx.Rngs(params=0, dropout=0)
    model = Decoder(specs, rngs=rngs)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 0.02, warmup_steps=2, decay_steps=10)
    # The example's eps is 1e-9; eps = the peak rate keeps rounding noise at noise level
    # (registry.adam).
    optimizer = nnx.Optimizer(model, optax.adamw(schedule, b1=0.9, b2=0.98, eps=0.02,
                                                 weight_decay=0.1), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"), accuracy=nnx.metrics.Accuracy())
    return model, optimizer, rngs, metrics


@functools.cache
def host_batches():
    """Packed-example batches (inputs, targets, positions, segmentation), with padding at the end of
    each row."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        tokens = rng.integers(1, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)
        tokens[:, -2:] = PAD
        segments = np.ones((BATCH, SEQ), np.int32)
        segments[:, SEQ // 2 :] = 2  # two packed sequences per row
        segments[:, -2:] = 0
        positions = np.concatenate([np.arange(SEQ // 2)] * 2).astype(np.int32)
        out.append(
            {
                "inputs": tokens[:, :-1],
                "targets": tokens[:, 1:],
                "inputs_position": np.tile(positions, (BATCH, 1)),
                "inputs_segmentation": segments,
            }
        )
    return out


def train(jitted, model, optimizer, rngs, metrics, batches, on_step=lambda step: None):
    """The example's loop body: positional call; the state-returning step's result goes back via
    nnx.update."""
    losses = []
    for step, batch in enumerate(batches):
        output = jitted(model, optimizer, rngs, batch, metrics, 0.1, PAD)  # label_smoothing, pad_id
        if isinstance(output, tuple):
            updates, _ = output
            nnx.update((model, optimizer, rngs, metrics), updates)
        losses.append(float(metrics.compute()["loss"]))
        on_step(step)
    return losses


# ==================================================================================================
# Helpers
# ==================================================================================================
def the_mesh():
    if len(jax.devices()) < 8:
        pytest.skip("the gemma-shaped program needs 8 devices, this backend has "
                    f"{len(jax.devices())}")
    # JAX's default axis types (Explicit), as the example
    return jax.make_mesh((4, 2), ("fsdp", "tensor"))


def placed(batches, mesh):
    return [jax.device_put(b, NamedSharding(mesh, P("fsdp"))) for b in batches]


def _norm(spec) -> tuple:
    spec = tuple(spec or ())
    while spec and spec[-1] is None:  # P('a', None) and P('a') are one layout
        spec = spec[:-1]
    return spec


def _spec(x) -> tuple:
    return _norm(getattr(x.sharding, "spec", ()))


def layouts(model, optimizer) -> dict[str, tuple]:
    """``x.sharding.spec`` of every parameter and optimizer-state array (rank >= 1), by path."""
    out = {}
    for name, obj in (("model", model), ("optimizer", optimizer)):
        for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(obj)):
            if isinstance(leaf, jax.Array) and leaf.ndim:
                out[name + jax.tree_util.keystr(path)] = _spec(leaf)
    return out


def layout_drift(want, model, optimizer, step):
    got = layouts(model, optimizer)
    return [f"after step {step + 1}: {k} {want[k]} -> {got.get(k)}" for k in want
            if got.get(k) != want[k]]


def params_of(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def assert_same(losses, params, want_losses, want_params, what):
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL, err_msg=f"{what}: losses")
    for i, (g, w) in enumerate(zip(params, want_params, strict=True)):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL,
                                   err_msg=f"{what}: parameter {i} after {STEPS} steps")


def plain_step(kind):
    """The example's own jit: ``nnx.jit`` for the in-place step, ``jax.jit`` for the state-returning
    one."""
    jit = nnx.jit if kind == "nnx" else jax.jit
    return jit(STEP_FNS[kind], static_argnames=("label_smoothing", "pad_id"),
               donate_argnames=("model", "optimizer"))


@functools.cache
def one_device(kind):
    """The reference: no mesh, no annotations, one device, the same steps through plain ``nnx.jit``
    / ``jax.jit``."""
    model, optimizer, rngs, metrics = build(Specs.unannotated())
    step = plain_step(kind)
    batches = [jax.device_put(b, jax.devices()[0]) for b in host_batches()]
    return train(step, model, optimizer, rngs, metrics, batches), params_of(model)


@functools.cache
def annotated_layouts():
    """Every array's layout as the example's own construction places it on the 4x2 mesh (under
    set_mesh)."""
    with jax.set_mesh(the_mesh()):
        model, optimizer, _, _ = build(Specs.fsdp_and_tensor())
        return layouts(model, optimizer)


def strategy_step(strategy, kind, **declarations):
    return strategy.jit(
        STEP_FNS[kind],
        static_argnames=("label_smoothing", "pad_id"),
        donate_argnames=("model", "optimizer"),
        **declarations,
    )


# ==================================================================================================
# (a) The program is right: plain JAX on the 4x2 mesh equals one device, in the layout it annotated.
# ==================================================================================================
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nnx", "jax"])
def test_program_on_its_mesh_equals_one_device(kind):
    mesh = the_mesh()
    want_losses, want_params = one_device(kind)
    with jax.set_mesh(mesh):
        model, optimizer, rngs, metrics = build(Specs.fsdp_and_tensor())
        # The annotations took: each parameter is created in the spec its Variable metadata names.
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            spec = var.get_metadata()["out_sharding"]
            assert _spec(var.get_value()) == _norm(spec), (
                f"{path}: created {var.get_value().sharding.spec}"
            )
        want_layout = layouts(model, optimizer)
        assert want_layout == annotated_layouts()
        assert ("tensor", "fsdp") in want_layout.values() and (
            "fsdp",
            "tensor",
        ) in want_layout.values()
        step = plain_step(kind)
        drift = []
        losses = train(
            step,
            model,
            optimizer,
            rngs,
            metrics,
            placed(host_batches(), mesh),
            lambda i: drift.extend(layout_drift(want_layout, model, optimizer, i)),
        )
        assert_same(losses, params_of(model), want_losses, want_params,
                    f"{kind}.jit on the 4x2 mesh")
        assert not drift, drift


# ==================================================================================================
# (b) Through strategy.jit, called exactly like the example calls its jitted step.
# ==================================================================================================
# The quick tier runs the in-place (nnx) step; the state-returning (jax) one, a second program of
# the same model through the same strategy.jit, is in the full suite.
KINDS = pytest.mark.parametrize("kind", ["nnx", pytest.param("jax", marks=pytest.mark.slow)])


@pytest.mark.parametrize("built_in", ["scope", "set_mesh"])
@KINDS
def test_strategy_jit_equals_one_device_and_keeps_annotated_layouts(kind, built_in):
    mesh = the_mesh()
    want_losses, want_params = one_device(kind)
    strategy = jd.ShardedStrategy(mesh=mesh, batch_axes=("fsdp",))
    # The example builds and steps under its own jax.set_mesh; a strategy user does both in scope().
    with strategy.scope() if built_in == "scope" else jax.set_mesh(mesh):
        model, optimizer, rngs, metrics = build(Specs.fsdp_and_tensor())
        want_layout = annotated_layouts()
        assert layouts(model,
                       optimizer) == want_layout, f"created in {built_in}: not the annotated layout"
        step = strategy_step(strategy, kind)
        drift = []
        losses = train(
            step,
            model,
            optimizer,
            rngs,
            metrics,
            placed(host_batches(), mesh),
            lambda i: drift.extend(layout_drift(want_layout, model, optimizer, i)),
        )
        assert_same(losses, params_of(model), want_losses, want_params,
                    f"strategy.jit({kind}_train_step)")
        assert not drift, drift


@KINDS
def test_strategy_jit_declared_host_batches(kind):
    """Host (numpy) batches, declared by name: split over the fsdp axis by jaxdist, same numbers and
    layouts."""
    mesh = the_mesh()
    want_losses, want_params = one_device(kind)
    strategy = jd.ShardedStrategy(mesh=mesh, batch_axes=("fsdp",))
    with strategy.scope():
        model, optimizer, rngs, metrics = build(Specs.fsdp_and_tensor())
        want_layout = annotated_layouts()
        step = strategy_step(strategy, kind, batch_argnames=("batch",))
        drift = []
        losses = train(
            step,
            model,
            optimizer,
            rngs,
            metrics,
            host_batches(),
            lambda i: drift.extend(layout_drift(want_layout, model, optimizer, i)),
        )
        assert_same(losses, params_of(model), want_losses, want_params,
                    f"strategy.jit({kind}_train_step), host batch")
        assert not drift, drift


# ==================================================================================================
# (c) Nothing annotated on a 4x2 mesh: the tensor devices would all do the same work. jaxdist says
# so.
# ==================================================================================================
def plain_error(mesh):
    """The exception type plain ``nnx.jit`` raises on the unannotated program on ``mesh`` (None: it
    runs).

    On an Explicit mesh it raises, as gemma's ``ShardingConfig.no_sharding()`` does: the embedding
    gather of a whole table by fsdp-split tokens has no unambiguous output sharding, and JAX asks
    for ``out_sharding=``."""
    with jax.set_mesh(mesh):
        model, optimizer, rngs, metrics = build(Specs.unannotated())
        try:
            train(
                plain_step("nnx"), model, optimizer, rngs, metrics, placed(host_batches()[:1], mesh)
            )
        except Exception as e:  # recorded: the jaxdist step may raise the same
            return type(e)
    return None


def test_unannotated_program_warns_idle_tensor_axis():
    """The example's own (Explicit) mesh: jaxdist warns about the idle axis; what the step does next
    is what plain JAX does with this program on this mesh (it raises there, see `plain_error`)."""
    mesh = the_mesh()
    error = plain_error(mesh)
    strategy = jd.ShardedStrategy(mesh=mesh, batch_axes=("fsdp",))
    with strategy.scope():
        model, optimizer, rngs, metrics = build(Specs.unannotated())
        step = strategy_step(strategy, "nnx")
        with (pytest.warns(jd.IdleAxisWarning, match="tensor"),
              contextlib.suppress(*filter(None, [error]))):
            train(step, model, optimizer, rngs, metrics, placed(host_batches()[:1], mesh))


@pytest.mark.slow
def test_unannotated_program_on_auto_mesh_warns_and_equals_one_device():
    """The same program on the same mesh with Auto axes, where plain JAX runs it: the idle axis
    wastes the tensor devices, jaxdist says so, and the numbers are still one device's."""
    the_mesh()
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    assert plain_error(mesh) is None
    want_losses, want_params = one_device("nnx")
    strategy = jd.ShardedStrategy(mesh=mesh, batch_axes=("fsdp",))
    with strategy.scope():
        model, optimizer, rngs, metrics = build(Specs.unannotated())
        step = strategy_step(strategy, "nnx")
        with pytest.warns(jd.IdleAxisWarning, match="tensor"):
            losses = train(step, model, optimizer, rngs, metrics, placed(host_batches(), mesh))
    assert_same(losses, params_of(model), want_losses, want_params,
                "unannotated strategy.jit(nnx_train_step)")
