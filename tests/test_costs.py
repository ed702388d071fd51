"""The cost model (`jaxdist.costs`): FLOPs as the device does them, on CPU and in programs compiled
for an H100."""

import gzip
import json
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdist as jd
from jaxdist.costs.kernels import custom_call_cost
from jaxdist.costs.text import parse

# programs compiled on an H100 (README)
FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "gpu"
# Analytic FLOPs per step (the fixtures' README): the LM step (6 x parameters + 12 x layers x
# d_model x sequence) x tokens, attention counted whole; the ragged products 3 x 2 x M x K x N.
ANALYTIC = {
    "lm_xla_h100": (4.587e12, 0.08),
    "lm_cudnn_h100": (4.587e12, 0.08),
    "ragged_lax_h100": (4.123e11, 0.03),
    "ragged_tokamax_h100": (4.123e11, 0.03),
}


def fixture_text(name: str) -> str:
    with gzip.open(FIXTURES / f"{name}.hlo.txt.gz", "rt") as f:  # in the repository: never skipped
        return f.read()


@pytest.mark.parametrize("name", sorted(ANALYTIC))
def test_programs_compiled_for_an_h100_count_their_analytic_flops(name):
    analytic, tolerance = ANALYTIC[name]
    cost = jd.program_cost(fixture_text(name))
    assert cost.flops == pytest.approx(analytic, rel=tolerance)
    assert cost.uncosted == () and not cost.lower_bound
    # library calls and kernels: XLA's analysis counts 0
    assert sum(cost.kernels.values()) > 0.45 * cost.flops


def test_fixture_kernels_are_named_by_kind():
    cudnn = jd.program_cost(fixture_text("lm_cudnn_h100"))
    assert set(cudnn.kernels) == {"cuBLAS gemm", "cuDNN attention"}
    # B 8, H 16, T 1024, D 64, causal (the lower triangle): 2 forward products, 5 backward, 4 layers
    pairs = 1024 * 1025 / 2
    assert cudnn.kernels["cuDNN attention"] == 4 * 7 * 2 * 8 * 16 * pairs * 64
    # the scores the flash backward recomputes
    assert cudnn.recomputed_flops == 4 * 2 * 8 * 16 * pairs * 64
    masked = 1024 * 1024 - pairs
    # the mask's half: 2 products forward, 4 back
    assert cudnn.skipped_flops == 4 * 6 * 2 * 8 * 16 * masked * 64
    # model FLOPs: attention whole, as the analytic count has it
    for name in ("lm_xla_h100", "lm_cudnn_h100"):
        assert jd.program_cost(fixture_text(name)).model_flops == pytest.approx(4.587e12, rel=0.02)
    lax = jd.program_cost(fixture_text("ragged_lax_h100"))
    assert set(lax.kernels) == {"ragged dot (cuBLAS over masked operands)"}
    assert lax.kernels["ragged dot (cuBLAS over masked operands)"] == 3 * 2 * 32768 * 1024 * 2048
    tokamax = jd.program_cost(fixture_text("ragged_tokamax_h100"))
    assert tokamax.kernels == {"ragged dot (tokamax)": 3 * 2 * 32768 * 1024 * 2048}


def test_a_custom_call_that_cannot_be_costed_is_named_and_makes_the_count_a_lower_bound():
    text = fixture_text("ragged_tokamax_h100")
    # no description left
    hidden = text.replace('metadata_payload="tokamax:', 'metadata_payload="other:')
    cost = jd.program_cost(hidden)
    assert cost.lower_bound and len(cost.uncosted) == 3
    assert all(u.startswith("mosaic_gpu_v2 (jit(fb)/") for u in cost.uncosted)
    assert cost.flops < 0.01 * ANALYTIC["ragged_tokamax_h100"][0]
    assert "at least" in str(jd.costs.roofline(cost.flops, cost.bytes_accessed, 0.0, "h100",
                                               lower_bound_flops=True))


@pytest.mark.parametrize("quoted", [False, True], ids=["json", "quoted_string"])
def test_a_pallas_cost_estimate_in_the_backend_config_is_counted(quoted):
    config = '{"custom_call_config": {"body": "TUxJUg==", "cost_estimate": {"flops": 1234, "transcendentals": 5}}}'
    if quoted:  # how HLO text prints a custom call's own string config (Mosaic TPU)
        config = json.dumps(config)
    text = "\n".join([
        "ENTRY %main (a: f32[8]) -> f32[8] {",
        "  %a = f32[8]{0} parameter(0)",
        f'  ROOT %k = f32[8]{{0}} custom-call(%a), custom_call_target="tpu_custom_call", '
        f'backend_config={config}',
        "}",
    ])
    module = parse(text)
    kernel = custom_call_cost(module.defs["k"], module)
    assert (kernel.flops, kernel.transcendentals) == (1234.0, 5.0)
    assert jd.program_cost(text).flops == 1234.0


def mlp_step():
    model = nn.Sequential([nn.Dense(128), nn.relu, nn.Dense(10)])
    x, y = jnp.ones((32, 64)), jnp.zeros(32, jnp.int32)
    params = model.init(jax.random.key(0), x)
    opt = optax.adam(1e-3)

    def step(params, opt_state, x, y):
        loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()  # noqa: E731
        grads = jax.grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(step).lower(params, opt.init(params), x, y).compile()


def conv_step():
    model = nn.Sequential([nn.Conv(8, (3, 3)), nn.relu, nn.Conv(4, (3, 3), strides=2)])
    x = jnp.ones((4, 16, 16, 3))
    params = model.init(jax.random.key(0), x)
    return (
        jax.jit(jax.grad(lambda p, x: (model.apply(p, x) ** 2).mean())).lower(params, x).compile()
    )


@pytest.mark.parametrize("program", [mlp_step, conv_step], ids=["mlp_adam_step", "conv_grad"])
def test_cpu_programs_count_as_xla_counts_them(program):
    compiled = program()
    cost = jd.program_cost(compiled)
    xla = compiled.cost_analysis()
    assert cost.flops == pytest.approx(xla["flops"], rel=0.01)
    assert cost.transcendentals == pytest.approx(xla.get("transcendentals", 0.0), rel=0.01, abs=1)
    assert cost.uncosted == () and cost.kernels == {}


def test_an_hlo_ragged_dot_counts_the_grouped_product():
    # forward and the two backward products, as XLA keeps them where the backend has them
    text = "\n".join([
        "ENTRY %main (x: bf16[4096,256], w: bf16[8,256,512], g: s32[8], ct: bf16[4096,512]) -> "
        "bf16[4096,512] {",
        "  %x = bf16[4096,256]{1,0} parameter(0)", "  %w = bf16[8,256,512]{2,1,0} parameter(1)",
        "  %g = s32[8]{0} parameter(2)", "  %ct = bf16[4096,512]{1,0} parameter(3)",
        "  %y = bf16[4096,512]{1,0} ragged-dot(%x, %w, %g), lhs_contracting_dims={1}, "
        "rhs_contracting_dims={1}, lhs_ragged_dims={0}, rhs_group_dims={0}",
        "  %wt = bf16[8,512,256]{2,1,0} transpose(%w), dimensions={0,2,1}",
        "  %dx = bf16[4096,256]{1,0} ragged-dot(%ct, %wt, %g), lhs_contracting_dims={1}, "
        "rhs_contracting_dims={1}, lhs_ragged_dims={0}, rhs_group_dims={0}",
        "  %dw = bf16[8,256,512]{2,1,0} ragged-dot(%x, %ct, %g), lhs_contracting_dims={0}, "
        "rhs_contracting_dims={0}, lhs_ragged_dims={0}",
        "  ROOT %t = (bf16[4096,512]{1,0}, bf16[4096,256]{1,0}, bf16[8,256,512]{2,1,0}) tuple(%y, "
        "%dx, %dw)",
        "}",
    ])
    assert jd.program_cost(text).flops == 3 * 2 * 4096 * 256 * 512


def test_a_cudnn_convolution_counts_as_the_convolution_it_replaced():
    text = conv_step().as_text()
    assert " convolution(" in text
    # XLA:GPU writes each convolution as a cuDNN call that keeps the convolution's window and
    # dimension labels
    on_gpu = text.replace(" convolution(", " custom-call(").replace(
        ", window=", ', custom_call_target="__cudnn$convForward", window=')
    gpu, cpu = jd.program_cost(on_gpu), jd.program_cost(text)
    assert (gpu.flops == cpu.flops and gpu.kernels["cuDNN convolution"] > 0.9 * cpu.flops
            and gpu.uncosted == ())


def test_a_scan_counts_every_iteration_as_the_unrolled_loop_does():
    def layers(unroll):
        def f(w, x):
            return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w,
                                unroll=unroll)[0].sum()
        return jax.jit(jax.grad(f, argnums=(0, 1))).lower(jnp.ones((6, 32, 32)),
                                                          jnp.ones((8, 32))).compile()

    looped, unrolled = layers(1), layers(True)
    assert "while" in looped.as_text() and "while" not in unrolled.as_text()
    xla_unrolled = unrolled.cost_analysis()["flops"]
    assert jd.program_cost(looped).flops == pytest.approx(xla_unrolled, rel=0.05)
    assert looped.cost_analysis()["flops"] < 0.5 * xla_unrolled  # XLA counts the loop body once
    assert jd.program_cost(unrolled).flops == pytest.approx(xla_unrolled, rel=0.01)


def test_rematerialised_work_is_executed_flops_but_not_model_flops():
    def f(w, x):
        return jax.checkpoint(lambda x: jnp.tanh(x @ w) @ w)(x).sum()

    # the loss is returned too: the forward pass is live, as in a step
    args = jnp.ones((64, 64)), jnp.ones((16, 64))
    plain = jax.value_and_grad(lambda w, x: (jnp.tanh(x @ w) @ w).sum())
    plain = jd.program_cost(jax.jit(plain).lower(*args).compile())
    remat = jd.program_cost(jax.jit(jax.value_and_grad(f)).lower(*args).compile())
    assert plain.recomputed_flops == 0 and plain.model_flops == plain.flops
    assert remat.recomputed_flops >= 2 * 16 * 64 * 64  # the forward matmul again
    assert remat.flops > plain.flops and remat.model_flops == pytest.approx(plain.flops, rel=0.05)


def test_plan_flops_are_program_cost_flops():
    strategy = jd.ShardedStrategy(min_shard_size=1)
    w, x = (jax.ShapeDtypeStruct((256, 128), jnp.float32),
            jax.ShapeDtypeStruct((64, 256), jnp.float32))

    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: ((x @ w) ** 2).mean())(w)

    plan = strategy.plan(step, w, x, batch_argnums=1)
    compiled = strategy.jit(step, batch_argnums=(1,)).lower(jnp.ones(w.shape),
                                                            jnp.ones(x.shape)).compile()
    cost = jd.program_cost(compiled)
    assert (plan.flops == cost.flops and plan.bytes_accessed == cost.bytes_accessed
            and plan.uncosted == ())
    assert [c.kind for c in cost.collectives] and {a for c in cost.collectives
                                                   for a in c.axes} <= {"replica"}


def test_program_cost_refuses_what_is_not_a_compiled_program():
    lowered = jax.jit(lambda a: a * 2).lower(jnp.ones(4))
    with pytest.raises(
        ValueError, match=r"compiled_or_text=Lowered is not a compiled .*\(lowered\.compile\(\)"
    ):
        jd.program_cost(lowered)
    with pytest.raises(ValueError,
                       match=r"compiled_or_text=int .* pass "
                             r"jax\.jit\(f\)\.lower\(\*args\)\.compile\(\)"):
        jd.program_cost(3)
    with pytest.raises(ValueError,
                       match=r"axis_names=\('a', 'b'\) and axis_sizes=\(2,\) differ in length"):
        jd.program_cost(lowered.compile(), axis_names=("a", "b"), axis_sizes=(2,))


@pytest.mark.parametrize(
    ("kind", "name"),
    [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100-pcie"),
     ("NVIDIA H100 NVL", "h100-nvl"),
     ("NVIDIA H200", "h200"), ("NVIDIA B200", "b200"), ("NVIDIA A100-SXM4-80GB", "a100"),
     ("TPU v5p", "tpu-v5p"), ("TPU v6 lite", "tpu-v6e"), ("cpu", None)],
)
def test_one_table_of_peaks_by_name_and_device_kind(kind, name):
    row = jd.costs.accelerator_of_device(kind)
    assert (row.name if row else None) == name
    if row:
        assert jd.costs.accelerator(name) is row
        assert jd.costs.known_peak_flops(kind) == (row.flops, row.source)


def test_an_unknown_accelerator_name_lists_the_table():
    with pytest.raises(ValueError,
                       match=r"accelerator='h300' is not in the table .* 'h100'.* "
                             r"jd\.costs\.Accelerator"):
        jd.costs.accelerator("h300")


def test_the_roofline_names_its_bound():
    e = jd.costs.roofline(989.4e12, 3.35e12 * 2, 0.0, "h100")
    assert (e.compute_s, e.memory_s, e.step_s, e.bound) == (1.0, 2.0, 2.0, "memory")
    assert np.isclose(jd.costs.roofline(0.0, 0.0, 450e9, "h100").network_s, 1.0)


def test_progress_marks_utilisation_a_lower_bound_while_a_custom_call_is_not_costed():
    import io

    out = io.StringIO()
    progress = jd.training.Progress(mode="lines", stream=out)
    cost = jd.training.StepCost(2e12, "program_cost", 1e15, "given", 0, 0, 0, None, "gpu", 1,
                                model_flops=2e12, uncosted=("mosaic_gpu_v2 (jit(step)/my_kernel)",))
    progress.on_step_cost(None, cost)
    progress.on_log(None, 10, {"loss": 1.0, "mfu": 0.25, "hfu": 0.25})
    lines = out.getvalue().splitlines()
    assert (
        lines[0] == "per device: at least 2 TFLOP/step, params 0 B, optimizer 0 B, peak 1 PFLOP/s"
    )
    assert lines[1] == "step 10 loss 1 mfu >=25.00% hfu >=25.00%"
    detailed = io.StringIO()
    jd.training.Progress(mode="lines", stream=detailed, details=True).on_step_cost(None, cost)
    assert ("at least: 1 custom call(s) not costed: mosaic_gpu_v2 (jit(step)/my_kernel)"
            in detailed.getvalue())
