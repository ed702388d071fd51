"""The names users import keep importing: every public name of every public package. A name removed
or moved out of its package fails here (say where it went in CHANGELOG.md); add new names freely
(the reference test in test_docs.py covers them). Each public name has one path: its package's, and,
for the names used most, also the top level (``jd.X``)."""

import importlib
import os
import subprocess
import sys
import traceback

import pytest

PUBLIC = {
    "jaxdist": [
        "DistributedDataset", "IdleAxisWarning", "InputContext", "LayoutPolicy", "MODEL_AXIS",
        "MirroredStrategy",
        "MultiStepContext", "MultiWorkerMirroredStrategy", "OneDeviceStrategy", "PerReplica",
        "Plan", "REPLICA_AXIS",
        "RecompileWarning", "ReduceOp", "ReplicaContext", "ShardedStrategy", "Strategy",
        "StrategyFunction",
        "SyncOnRead", "TPUStrategy", "UndeclaredBatchWarning", "UnmatchedLayoutRuleWarning",
        "ValueContext",
        "VariableAggregation", "compat", "compute_average_loss", "configure_compilation_cache",
        "costs",
        "get_replica_context", "get_strategy", "gradients", "has_strategy",
        "in_cross_replica_context",
        "initialize_cluster", "nn", "plan_mesh", "program_cost", "scale_regularization_loss", "tpu",
        "training",
    ],
    "jaxdist.costs": [
        "ACCELERATORS", "Accelerator", "COLLECTIVE_KINDS", "CollectiveOp", "Estimate",
        "ProgramCost", "accelerator",
        "accelerator_of_device", "known_peak_flops", "program_cost", "roofline",
    ],
    "jaxdist.strategies": [
        "Candidate", "DistributedDataset", "DistributedIterator", "HOST_OFFLOAD_MODES",
        "IdleAxisWarning", "InputContext", "LayoutPolicy", "MirroredStrategy", "MultiStepContext",
        "MultiWorkerMirroredStrategy", "OneDeviceStrategy", "Plan", "ProgramCache",
        "ProgramMismatchError",
        "RecompileWarning", "ReplicaContext", "ShardedStrategy", "Strategy", "StrategyExtended",
        "StrategyFunction", "UndeclaredBatchWarning", "UnmatchedLayoutRuleWarning", "ValueContext",
        "compat", "compute_average_loss", "get_replica_context", "get_strategy", "has_strategy",
        "in_cross_replica_context", "plan_mesh", "plan_search", "scale_regularization_loss",
    ],
    "jaxdist.strategies.compat": [
        "StrategyV1Names", "TowerContext", "get_distribution_strategy", "get_tower_context",
        "has_distribution_strategy",
    ],
    "jaxdist.replicate": [
        "MODEL_AXIS", "PerReplica", "REPLICA_AXIS", "ReduceOp", "SyncOnRead", "VariableAggregation",
        "batch_sharded", "component_name", "replicated",
    ],
    "jaxdist.gradients": [
        "AllReduceSynchronizer", "CastCompressor", "CastState", "Compressor", "NoneCompressor",
        "PowerSGDCompressor",
        "PowerSGDState", "SparseRows", "SynchronizerState", "all_gather_is_cheaper", "cluster",
        "cluster_of",
        "clusters", "current_cluster", "current_gradient_uid", "grad", "gradient_cluster",
        "is_sparse", "replica_count", "sparse_all_reduce", "value_and_grad", "vjp",
    ],
    "jaxdist.nn": [
        "MoE", "Pipeline", "bubble_fraction", "dot_product_attention", "exchange", "experts",
        "moe_loss", "nnx", "update_router_bias",
    ],
    "jaxdist.nn.nnx": [
        "MoE",
    ],
    "jaxdist.tpu": [
        "TPUStrategy", "host_compute_core", "outside_compilation",
    ],
    "jaxdist.training": [
        "CSVLogger", "Callback", "CheckpointCorruptedError", "Checkpointer", "DataPosition",
        "History",
        "JobDisagreementError", "LinenModel", "MLflowLogger", "NnxModel", "NonFiniteError",
        "NonFinitePolicy",
        "PreemptionWatcher", "Progress", "StepCost", "TensorBoardLogger", "TrainState", "Trainer",
        "Watchdog", "WandbLogger", "accuracy",
        "make_train_step", "prepare",
    ],
}


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_every_public_name_still_imports(package):
    module = importlib.import_module(package)
    missing = [name for name in PUBLIC[package] if not hasattr(module, name)]
    assert not missing, (
        f"{package} no longer has {missing}: keep a re-export (name as name) in its __init__"
    )
    dropped = sorted(set(PUBLIC[package]) - set(module.__all__))
    assert not dropped, f"{package}.__all__ no longer lists {dropped}"


def test_top_level_names_are_the_packages_objects():
    """``jd.X`` and ``jd.strategies.X`` are one object (a re-export, not a copy)."""
    top, strategies = (importlib.import_module("jaxdist"),
                       importlib.import_module("jaxdist.strategies"))
    for name in set(PUBLIC["jaxdist"]) & set(PUBLIC["jaxdist.strategies"]):
        assert getattr(top, name) is getattr(strategies, name), name


def test_each_public_name_has_one_package():
    """A public object is exported by one package (its owner) and, optionally, at the top level;
    never also by a sibling package (``jd.tpu.MultiStepContext`` beside
    ``jd.strategies.MultiStepContext``)."""
    owners: dict[int, list[str]] = {}
    for package in sorted(set(PUBLIC) - {"jaxdist"}):
        module = importlib.import_module(package)
        for name in module.__all__:
            value = getattr(module, name)
            # constants are compared by value nowhere
            if not isinstance(value, (int, float, str, tuple)):
                owners.setdefault(id(value), []).append(f"{package}.{name}")
    shared = sorted(paths for paths in owners.values() if len(paths) > 1)
    assert not shared, (
        f"exported by more than one package (keep one, and jd.X if it is used often): {shared}"
    )


def test_import_jaxdist_loads_no_jax_until_a_name_is_used():
    """``import jaxdist`` attaches its names (``jaxdist/__init__.pyi``) and imports each package on
    first use, so ``python -m jaxdist.launch`` starts without JAX; the names then resolve."""
    script = ("import sys, jaxdist as jd; assert 'jax' not in sys.modules, 'jax imported'; "
              "assert jd.MirroredStrategy is jd.strategies.MirroredStrategy; "
              "assert 'jax' in sys.modules; print(sorted(dir(jd)) == sorted(jd.__all__))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]


def test_a_misspelled_top_level_name_is_named_with_the_one_meant():
    import jaxdist as jd

    with pytest.raises(AttributeError) as error:
        jd.MirrorStrategy  # noqa: B018
    assert "MirrorStrategy" in str(error.value)
    shown = "".join(traceback.format_exception(error.value))
    assert "Did you mean: 'MirroredStrategy'?" in shown, shown


def test_a_linen_fit_loads_no_nnx_and_an_nnx_step_after_it_still_updates_in_place():
    """jaxdist never imports ``flax.nnx`` itself (a value can be an nnx object only once nnx is
    imported): a linen Trainer's fit and a ``strategy.jit`` step on plain arrays leave it out; an
    nnx module passed to a step of the same process afterwards is still taken as ``nnx.jit``
    takes it: its in-place update written back."""
    script = """
import sys
import flax.linen as nn, jax, jax.numpy as jnp, numpy as np, optax
import jaxdist as jd
strategy = jd.MirroredStrategy()
double = strategy.jit(lambda x: 2 * x)
assert float(double(jnp.ones(8))[0]) == 2.0
trainer = jd.training.Trainer(strategy, nn.Dense(2), optax.sgd(0.1),
                              lambda out, y: ((out - y) ** 2).mean())
x, y = np.ones((8, 3), np.float32), np.zeros((8, 2), np.float32)
trainer.fit([(x, y)], steps=2, verbose=0)
loaded = [name for name in ("flax.nnx", "jaxdist.nn.nnx") if name in sys.modules]
from flax import nnx
model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
def bump(m, x):
    m.bias[...] += 1.0
    return x
strategy.jit(bump)(model, jnp.ones(8))
print(loaded, float(model.bias[...][0]))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=180, env={**os.environ, "JAX_NUM_CPU_DEVICES": "8"})
    assert out.returncode == 0 and out.stdout.strip() == "[] 1.0", out.stdout + out.stderr[-3000:]
