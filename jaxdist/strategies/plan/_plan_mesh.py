"""Meshes to plan on, not to run on: a mesh of any shape without its devices, and a compiler that
has them.

`plan_mesh` returns a `jax.sharding.AbstractMesh`: axis names and sizes, no devices. Every strategy
accepts it as ``mesh=``; it can then plan (``strategy.create_variables`` gives abstract values with
their layouts, ``strategy.jit(step).plan(...)`` compiles the step) but not run (`refuse_to_run`): a
1,024-device plan from a laptop.

JAX lowers for an abstract mesh; compiling needs the devices, which `compile_elsewhere` simulates.
What comes back is exact on every backend where it is decided before the backend's own passes (the
arguments' and outputs' bytes per device, which collectives run and on how many bytes) and the CPU
compiler's estimate of another backend where it is not (temporaries and peak: another backend
fuses, schedules and rematerializes differently; XLA:CPU also computes 16-bit float collectives
in float32).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType

from jaxdist.costs.plan import MEMORY_FIELDS
from jaxdist.replicate.trees import fn_name, merge_static, split_static
from jaxdist.strategies.layout import decided, initializer, leave_auto

__all__ = ["abstract_variables", "compile_elsewhere", "is_plan_mesh", "plan_mesh", "refuse_to_run"]


# Run in a fresh interpreter with N simulated CPU devices: compile an MLIR module for them, report
# the memory analysis and the compiled text (compile options for a raw module: jax's own helper).
_COMPILER = """
import json, sys
import jax
n = int(sys.argv[3])
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", n)
import jax.extend
import numpy as np
from jax._src import compiler
from jax._src.lib import xla_client as xc
backend = jax.extend.backend.get_backend("cpu")
devices = backend.devices()[:n]
options = compiler.get_compile_options(num_replicas=1, num_partitions=n,
                                       device_assignment=np.array(devices).reshape(1, n),
                                       backend=backend)
with open(sys.argv[1]) as f:
    module = f.read()
executable = backend.compile_and_load(module, xc.DeviceList(tuple(devices)), options)
stats = executable.get_compiled_memory_stats()
fields = json.loads(sys.argv[4])
with open(sys.argv[2], "w") as f:
    json.dump({"memory": {k: int(getattr(stats, k)) for k in fields},
               "text": executable.hlo_modules()[0].to_string()}, f)
"""


def plan_mesh(shape: Mapping[str, int],
              axis_types: AxisType | tuple[AxisType, ...] = AxisType.Auto) -> AbstractMesh:
    """A mesh of ``shape`` without devices, for plans (see the module doc).

    Args:
        shape: ``{axis name: size}``, in mesh order, e.g. ``{"data": 16, "fsdp": 32, "tensor": 8}``.
        axis_types: one `jax.sharding.AxisType` for every axis, or one per axis. ``Auto`` (the
            default, as on the meshes jaxdist builds): XLA propagates layouts through unannotated
            code; ``Explicit`` for model code written for ``jax.make_mesh``'s default (sharding in
            types).

    Returns:
        A `jax.sharding.AbstractMesh`.

    Raises:
        ValueError: for an empty shape, a name that is not a non-empty string, a size that is not an
            int >= 1, or ``axis_types`` that are not AxisTypes (one, or one per axis).

    Examples:
        >>> import jax, jaxdist as jd
        >>> mesh = jd.plan_mesh({"data": 16, "fsdp": 32, "tensor": 8})
        >>> mesh.size, mesh.axis_names
        (4096, ('data', 'fsdp', 'tensor'))
        >>> big = jd.ShardedStrategy(mesh=mesh, batch_axes=("data", "fsdp"))
        >>> big.num_replicas_in_sync
        512
        >>> jd.plan_mesh({"data": 8}, jax.sharding.AxisType.Explicit).axis_types
        (Explicit,)
    """
    if not isinstance(shape, Mapping) or not shape:
        raise ValueError(f"shape={shape!r} must be a non-empty mapping of axis name to size, e.g. "
                         "plan_mesh({'data': 16, 'fsdp': 32}).")
    for name, size in shape.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"shape={dict(shape)!r}: axis name {name!r} must be a non-empty "
                             "string.")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"shape={dict(shape)!r}: axis {name!r} has size {size!r}; sizes are "
                             "ints >= 1.")
    types = (axis_types,) * len(shape) if isinstance(axis_types, AxisType) else tuple(axis_types)
    if len(types) != len(shape) or not all(isinstance(t, AxisType) for t in types):
        raise ValueError(f"axis_types={axis_types!r} must be one jax.sharding.AxisType or one per "
                         f"axis of {dict(shape)!r}, e.g. jax.sharding.AxisType.Explicit.")
    return AbstractMesh(tuple(shape.values()), tuple(shape), axis_types=types)


def is_plan_mesh(mesh: Any) -> bool:
    """Whether ``mesh`` is a mesh without devices (`plan_mesh`): plans only.

    Examples:
        >>> import jax
        >>> is_plan_mesh(plan_mesh({"data": 4})), is_plan_mesh(jax.make_mesh((1,), ("data",)))
        (True, False)
    """
    return isinstance(mesh, AbstractMesh)


def refuse_to_run(mesh: Any, what: str) -> None:
    """Raise when ``what`` would run on a mesh without devices; nothing otherwise.

    Raises:
        RuntimeError: naming ``what``, the mesh, and what a plan mesh is for.

    Examples:
        >>> try:
        ...     refuse_to_run(plan_mesh({"data": 1024}), "calling step")
        ... except RuntimeError as error:
        ...     print(str(error)[:52])
        calling step needs devices, but this strategy's mesh
    """
    if is_plan_mesh(mesh):
        raise RuntimeError(f"{what} needs devices, but this strategy's mesh {dict(mesh.shape)} is "
                           "a plan mesh (jd.plan_mesh): it can plan, not run. Call "
                           "step.plan(*args) (or strategy.plan(step, *args)) for its memory, FLOPs "
                           "and collectives, and run on a strategy built over real devices "
                           "(mesh=jax.make_mesh(...)).")


def abstract_variables(policy: Any, init_fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``init_fn(*args, **kwargs)``'s shapes (`jax.eval_shape`: nothing runs) in ``policy``'s
    variable layout.

    Raises:
        TypeError: when ``init_fn`` is not callable.
    """
    if not callable(init_fn):
        raise TypeError(f"init_fn={init_fn!r} (type {type(init_fn).__name__}) is not callable: "
                        "pass the function that builds the variables, e.g. "
                        "strategy.create_variables(model.init, rng, x).")
    dynamic, treedef, statics = split_static((args, kwargs))
    name = fn_name(init_fn)
    mesh = policy.mesh

    def call(dyn: tuple) -> Any:
        call_args, call_kwargs = merge_static(dyn, treedef, statics)
        return init_fn(*call_args, **call_kwargs)

    def fn(*dyn):
        # with the axis types create_variables would run it with
        out, auto = initializer(mesh, name, call, dyn)
        return leave_auto(mesh, out) if auto else out

    fn.__name__ = fn.__qualname__ = name
    shapes = decided(mesh, None, lambda: jax.eval_shape(fn, *dynamic), name)
    return jax.tree.map(lambda s, layout: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=layout),
                        shapes, policy.variable_shardings(shapes))


def compile_elsewhere(module_text: str, num_devices: int,
                      timeout: float = 900.0) -> tuple[dict[str, int], str]:
    """Compile a lowered module (StableHLO text) for ``num_devices`` simulated CPU devices in a
    subprocess (``jax_num_cpu_devices``).

    Args:
        module_text: ``lowered.as_text()`` of a program lowered for a mesh of ``num_devices``
            devices.
        num_devices: how many devices the program is partitioned over.
        timeout: seconds before the subprocess is stopped.

    Returns:
        ``(memory, text)``: the compiled program's memory analysis
        (`jaxdist.costs.plan.MEMORY_FIELDS`, bytes per device) and its compiled HLO text.

    Raises:
        RuntimeError: when the subprocess fails or takes longer than ``timeout`` (the message holds
            the end of its output).
    """
    with tempfile.TemporaryDirectory(prefix="jaxdist-plan-") as tmp:
        source, result = os.path.join(tmp, "module.mlir"), os.path.join(tmp, "compiled.json")
        with open(source, "w") as f:
            f.write(module_text)
        env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
        env["JAX_PLATFORMS"] = "cpu"
        start = time.perf_counter()
        try:
            command = [sys.executable, "-c", _COMPILER, source, result, str(num_devices),
                       json.dumps(MEMORY_FIELDS)]
            done = subprocess.run(command, env=env, capture_output=True, text=True,
                                  timeout=timeout, check=False)
        except subprocess.TimeoutExpired as error:
            raise RuntimeError(f"compiling the plan for {num_devices} simulated CPU devices took "
                               f"longer than timeout={timeout} s: pass a larger timeout, or plan a "
                               "smaller mesh.") from error
        if done.returncode != 0:
            raise RuntimeError(f"compiling the plan for {num_devices} simulated CPU devices failed "
                               f"(exit {done.returncode} after {time.perf_counter() - start:.1f} "
                               f"s):\n{done.stderr[-3000:]}")
        with open(result) as f:
            out = json.load(f)
    return out["memory"], out["text"]
