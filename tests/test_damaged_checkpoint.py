"""A damaged checkpoint: one clear error naming the step, the directory and the newest checkpoint
that restores; ``fit(restore_step=...)`` resumes from that one; no event-loop noise at exit.

Two kinds of damage, 16 flipped bytes in the middle of the largest file of:
* ``<step>/state/d/``, the OCDBT root b-tree nodes (and the values of at most 1 KiB stored inline in
  them), which tensorstore checks with CRC-32C;
* ``<step>/state/ocdbt.process_*/d/``, the array chunks larger than that, which carry no checksum in
  orbax's format: they restored as wrong values, silently, until the checksums jaxdist saves in
  ``meta`` (computed on the devices, compared after each restore). The model is wide enough (128)
  for some arrays to be stored there.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from registry import CLASSES, LAUNCH, host_leaves, launch_env, make, shuffled_batches

import jaxdist as jd
from jaxdist.training.checkpoints._damage import ChecksumMismatchError, checksums

HERE = Path(__file__).resolve().parent


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Dense(128)(x))  # kernels of 4 and 2 KiB: stored outside the b-tree nodes
        x = nn.Dropout(0.3, deterministic=not train)(x)
        return nn.Dense(CLASSES)(x)


data_fn = shuffled_batches  # 4 fixed batches, shuffled per epoch (deterministic)

SAMPLE = data_fn(0)[0]


def trainer(strategy=None):
    loss = lambda out, y: optax.softmax_cross_entropy_with_integer_labels(out, y).mean()  # noqa: E731
    return jd.training.Trainer(strategy or make("mirrored_2"), MLP(), optax.adam(1e-2), loss,
                               train_kwargs={"train": True}, seed=3)


def damage(step_dir: Path) -> None:
    """Flip 16 bytes in the middle of the largest file of ``step_dir/state/d`` (see the module
    docstring)."""
    largest = max((p for p in (step_dir / "state" / "d").iterdir() if p.is_file()),
                  key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    largest.write_bytes(bytes(data))


def damage_data(step_dir: Path, at: float = 0.5) -> None:
    """Flip 16 bytes at fraction ``at`` of the largest file of ``step_dir/state/ocdbt.process_*/d``
    (array chunks)."""
    largest = max((step_dir / "state").glob("ocdbt.process_*/d/*"), key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    middle = int(len(data) * at)
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    largest.write_bytes(bytes(data))


def drop_checksums(step_dir: Path) -> None:
    """Make ``step_dir`` a checkpoint as written before checksums: its metadata without them."""
    path = step_dir / "meta" / "metadata"
    info = json.loads(path.read_text())
    del info["checksums"]
    path.write_text(json.dumps(info))


def leaves(tree) -> dict[str, bytes]:
    return {jax.tree_util.keystr(p): a.tobytes() for (p, _), a in
            zip(jax.tree_util.tree_flatten_with_path(tree)[0], host_leaves(tree), strict=True)}


@pytest.fixture(scope="session")
def written(tmp_path_factory):
    """Checkpoints 10 and 20 written by fit, and the state at 20."""
    directory = tmp_path_factory.mktemp("written")
    run = trainer()
    run.fit(data_fn, steps=20, checkpoint_dir=directory, checkpoint_every=10, verbose=0)
    assert jd.training.Checkpointer(directory).all_steps() == [10, 20]
    return directory


@pytest.fixture
def damaged(written, tmp_path):
    """A copy of ``written`` whose checkpoint 20 is damaged."""
    directory = tmp_path / "ckpt"
    shutil.copytree(written, directory)
    damage(directory / "20")
    return directory


def test_the_error_names_the_step_the_directory_and_the_intact_checkpoint(damaged):
    where = re.escape(str(damaged))
    cause = r"\(DATA_LOSS in state/d/\w+: [^()]*checksum[^()]*\)"
    fresh = trainer()
    with pytest.raises(jd.training.CheckpointCorruptedError,
                       match=rf"^checkpoint 20 in '{where}' is unreadable {cause}: delete "
                             rf"{where}/20 to resume from "
                             r"10, or pass restore_step=10\.$") as info:
        fresh.fit(data_fn, steps=30, checkpoint_dir=damaged, verbose=0)
    error = info.value
    assert (error.step, error.intact_step, error.directory) == (20, 10, str(damaged))
    # one short line, not 2 KB of JSON (measured without the directory, whose length depends on the
    # machine)
    assert len(str(error).replace(str(damaged), "")) < 300 and "tensorstore_spec" not in str(error)
    # the full cause, kept unprinted
    assert error.__suppress_context__ and "DATA_LOSS" in str(error.__context__)
    assert pickle.loads(pickle.dumps(error)).args == error.args
    assert fresh.state is None and fresh.step == 0  # nothing half-restored

    with pytest.raises(jd.training.CheckpointCorruptedError,
                       match=r"to resume from 10, or pass step=10\.$"):
        fresh.restore(damaged, batch=SAMPLE)
    assert fresh.state is None
    like = trainer().init(SAMPLE)
    ckpt = jd.training.Checkpointer(damaged)
    with pytest.raises(jd.training.CheckpointCorruptedError,
                       match=rf"^checkpoint 20 in '{where}' .* pass step=10"):
        ckpt.restore(like)
    assert ckpt.restore(like, step=10)[1]["step"] == 10
    not_latest = jd.training.CheckpointCorruptedError(20, "/c", "DATA_LOSS", 10, (15,),
                                                      latest=False)
    assert str(not_latest).endswith("the newest older checkpoint that restores is 10 (15 failed "
                                    "too): pass step=10.")
    ckpt.delete(20)  # the fix the message gives
    assert ckpt.restore(like)[1]["step"] == 10
    ckpt.close()


def test_damaged_metadata_or_every_checkpoint(written, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(written, directory)
    (directory / "20" / "meta" / "metadata").write_bytes(b"{\"format\": ")  # truncated JSON
    ckpt = jd.training.Checkpointer(directory)
    with pytest.raises(jd.training.CheckpointCorruptedError,
                       match=r"checkpoint 20 .* \(meta: JSONDecodeError: .*\): delete .* to resume "
                             r"from 10"):
        ckpt.meta()
    with pytest.raises(jd.training.CheckpointCorruptedError,
                       match=r"\(meta: .* resume from 10, or pass step=10"):
        ckpt.data_iterator_state()
    damage(directory / "10")
    with pytest.raises(jd.training.CheckpointCorruptedError,
                       match=r"checkpoint 20 .*, and no older checkpoint restores \(10 failed "
                             r"too\): nothing here can "
                             r"resume this run; start again in an empty directory\.$"):
        trainer().restore(ckpt, batch=SAMPLE)
    ckpt.close()


def test_fit_restore_step_resumes_there_and_ends_as_an_uninterrupted_run(damaged):
    straight = trainer()
    straight.fit(data_fn, steps=30, verbose=0)
    resumed = trainer()
    history = resumed.fit(data_fn, steps=30, checkpoint_dir=damaged, checkpoint_every=10,
                          restore_step=10, verbose=0)
    assert resumed.step == 30 and resumed.data_position == straight.data_position
    for a, b in zip(host_leaves(resumed.state), host_leaves(straight.state), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    # the damaged 20 was deleted once 10 was restored, and written again by this run
    assert [os.path.basename(p) for p in history.checkpoints] == ["20", "30"]
    assert jd.training.Checkpointer(damaged).all_steps() == [10, 20, 30]
    again = trainer()
    assert again.restore(damaged, step=20, batch=SAMPLE) == 20  # readable now
    assert again.data_position == jd.training.DataPosition(5, 0)


def test_restore_step_that_is_not_there(damaged):
    with pytest.raises(FileNotFoundError,
                                                match=r"restore_step=15: .* has no checkpoint for "
                                                      r"step 15; it has steps "
                                                r"\[10, 20\]: pass one of them"):
        trainer().fit(data_fn, steps=30, checkpoint_dir=damaged, restore_step=15, verbose=0)
    with pytest.raises(ValueError, match=r"restore_step=10 needs checkpoint_dir="):
        trainer().fit(data_fn, steps=30, restore_step=10, verbose=0)
    with pytest.raises(ValueError, match=r"restore_step=-1 must be an int >= 0"):
        trainer().fit(data_fn, steps=30, checkpoint_dir=damaged, restore_step=-1, verbose=0)
    assert jd.training.Checkpointer(damaged).all_steps() == [10, 20]  # nothing deleted


@pytest.fixture
def data_damaged(written, tmp_path):
    """A copy of ``written`` whose checkpoint 20 has damaged array data, and the leaves that restore
    wrong from it when nothing checks them (what every restore did before the checksums).

    The chunks are compressed frames, and where they lie in the file depends on the order the writes
    finished in: a flip that lands on a frame's header makes the unchecked restore fail loudly
    instead of silently. Such a place is skipped for the next one, so the damage is always the
    silent kind the checksums exist for."""
    like = trainer().init(SAMPLE)
    intact = leaves(jd.training.Checkpointer(written).restore(like)[0])
    for i, at in enumerate((0.5, 0.6, 0.4, 0.7, 0.3, 0.8, 0.2, 0.9)):
        directory = tmp_path / f"ckpt{i}"
        shutil.copytree(written, directory)
        damage_data(directory / "20", at)
        unchecked = tmp_path / f"unchecked{i}"
        shutil.copytree(directory, unchecked)
        drop_checksums(unchecked / "20")
        try:
            # no error: wrong values
            restored = leaves(jd.training.Checkpointer(unchecked).restore(like)[0])
        except Exception:  # a broken frame header: loud already; damage another place
            continue
        wrong = [path for path in intact if restored[path] != intact[path]]
        if wrong:
            return directory, wrong
    pytest.fail("no flipped place changed a value silently: the test damages nothing")


def test_damaged_array_data_is_the_one_error_naming_the_leaf(data_damaged):
    directory, wrong = data_damaged
    where = re.escape(str(directory))
    leaf = re.escape(wrong[0])
    cause = rf"\(checksum mismatch in {leaf}[^()]*: the array data \(state/ocdbt\.process_\*/d/\) changed\)"
    ckpt = jd.training.Checkpointer(directory)
    like = trainer().init(SAMPLE)
    with pytest.raises(jd.training.CheckpointCorruptedError,
                       match=rf"^checkpoint 20 in '{where}' is unreadable {cause}: delete "
                             rf"{where}/20 to resume from "
                             r"10, or pass step=10\.$") as info:
        ckpt.restore(like)
    assert (info.value.step, info.value.intact_step) == (20, 10)
    mismatch = info.value.__context__
    # exactly the wrong ones
    assert isinstance(mismatch, ChecksumMismatchError) and list(mismatch.paths) == wrong
    assert pickle.loads(pickle.dumps(mismatch)).paths == mismatch.paths
    assert ckpt.restore(like, step=10)[1]["step"] == 10
    ckpt.close()

    fresh = trainer()  # fit's resume says the same, with fit's argument
    with pytest.raises(jd.training.CheckpointCorruptedError,
                       match=rf"^checkpoint 20 in '{where}' is unreadable {cause}: delete "
                             rf"{where}/20 to resume from "
                             r"10, or pass restore_step=10\.$"):
        fresh.fit(data_fn, steps=30, checkpoint_dir=directory, verbose=0)
    assert fresh.state is None and fresh.step == 0


def test_a_checkpoint_without_checksums_restores_as_before(written, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(written, directory)
    drop_checksums(directory / "20")
    like = trainer().init(SAMPLE)
    state, meta = jd.training.Checkpointer(directory).restore(like)
    assert "checksums" not in meta and meta["step"] == 20
    assert leaves(state) == leaves(jd.training.Checkpointer(written).restore(like)[0])


@pytest.mark.parametrize("name", ["sharded_8", "one_device"])
def test_checksums_do_not_depend_on_the_strategy(written, name):
    """Written under MirroredStrategy (2 devices), restored (and checked) under another: no false
    alarm."""
    strategy = (
        jd.ShardedStrategy(min_shard_size=1) if name == "sharded_8" else jd.OneDeviceStrategy()
    )
    run = trainer(strategy)
    assert run.restore(written, batch=SAMPLE) == 20
    if name == "sharded_8":
        assert any(not a.sharding.is_fully_replicated for a in jax.tree.leaves(run.state))
    assert checksums(run.state) == jd.training.Checkpointer(written).meta()["checksums"]


def test_checksums_depend_on_the_values_only():
    """The same values give the same checksums in any layout, in device or host memory, and from
    numpy; a flipped bit changes both sums, two swapped words the position-weighted one."""
    rng = np.random.default_rng(0)
    values = {
        "f32": rng.normal(size=(16, 24)).astype(np.float32),
        "bf16": rng.normal(size=(8, 4, 2)).astype(jnp.bfloat16),
        "i8": rng.integers(-100, 100, size=(40,)).astype(np.int8),
        "u16": rng.integers(0, 60000, size=(8,)).astype(np.uint16),
        "bool": rng.random((8, 3)) > 0.5,
        "c64": (rng.normal(size=(8, 2)) + 1j * rng.normal(size=(8, 2))).astype(np.complex64),
        "scalar": np.ones((), np.float32),
        "empty": np.zeros((0, 8), np.float32),
    }
    expected = checksums(values)  # numpy: summed on the host
    assert (list(expected) == [f"['{k}']" for k in sorted(values)]
            and expected["['scalar']"] == [0x3F800000] * 2)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
    P = jax.sharding.PartitionSpec
    layouts = [
        jax.devices()[3],
        *(jax.sharding.NamedSharding(mesh, s) for s in (P(), P("x"), P(None, "y"))),
    ]
    for layout in layouts:
        def put(a, layout=layout):
            ok = not isinstance(layout, jax.sharding.NamedSharding) or all(
                n is None or (i < a.ndim and a.shape[i] % mesh.shape[n] == 0)
                for i, n in enumerate(layout.spec))
            return jax.device_put(a, layout if ok else jax.sharding.NamedSharding(mesh, P()))
        assert checksums(jax.tree.map(put, values)) == expected, layout
    host_memory = jax.sharding.NamedSharding(mesh, P("x"), memory_kind="pinned_host")
    assert checksums({"f32": jax.device_put(values["f32"],
                                            host_memory)})["['f32']"] == expected["['f32']"]
    explicit = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    mixed = [
        jax.device_put(values["f32"], s)
        for s in (jax.devices()[0], jax.sharding.NamedSharding(mesh, P("x")),
                  jax.sharding.NamedSharding(explicit, P(None, "y")))
    ]
    # an ambient mesh that is not every array's, as inside a strategy's scope
    with jax.set_mesh(explicit):
        assert checksums(mixed) == {f"[{i}]": expected["['f32']"] for i in range(3)}
    keys = jax.random.split(jax.random.key(1), 8)
    spread = jax.device_put(keys, jax.sharding.NamedSharding(mesh, P(("x", "y"))))
    assert (checksums([keys]) == checksums([spread])
            == checksums([np.asarray(jax.random.key_data(keys))]))

    words = np.arange(10, dtype=np.uint32)
    flipped, swapped = words.copy(), words.copy()
    flipped[4] ^= 1 << 7
    swapped[[2, 5]] = swapped[[5, 2]]
    (a, b), (fa, fb), (sa, sb) = (
        checksums([jnp.asarray(w)])["[0]"] for w in (words, flipped, swapped)
    )
    assert fa != a and fb != b and sa == a and sb != b
    assert checksums({"w": jnp.zeros(4, jnp.int4)}) == {}  # sub-byte types: none (not checked)
    assert str(ChecksumMismatchError([".a"])).startswith("checksum mismatch in .a: ")
    assert str(ChecksumMismatchError([".a", ".b"])).startswith("checksum mismatch in .a and .b: ")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_process_that_resumes_from_a_damaged_checkpoint_exits_with_the_one_error(damaged):
    """Before the fix: tensorstore's 2 KB DATA_LOSS text, then a `RuntimeError: Event loop is
    closed` traceback per array read still in flight when orbax closed its event loop (printed or
    not depending on timing: in about half the processes; hence a few failed restores before the one
    that ends the process)."""
    code = (
        "import sys, jax\n"
        "jax.config.update('jax_num_cpu_devices', 8)\n"
        "jax.config.update('jax_platforms', 'cpu')\n"
        f"sys.path.insert(0, {str(HERE)!r})\n"
        "import jaxdist as jd\n"
        "from test_damaged_checkpoint import SAMPLE, data_fn, trainer\n"
        "for _ in range(4):\n"
        "    try:\n"
        "        trainer().restore(sys.argv[1], batch=SAMPLE)\n"
        "    except jd.training.CheckpointCorruptedError:\n"
        "        pass\n"
        "trainer().fit(data_fn, steps=30, checkpoint_dir=sys.argv[1], verbose=0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(damaged)], capture_output=True, text=True,
                         timeout=100)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Event loop is closed" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.count("Traceback") == 1, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    error = "jaxdist.training.checkpoints._damage.CheckpointCorruptedError"
    assert last.startswith(f"{error}: checkpoint 20 in '{damaged}'")
    assert last.endswith("resume from 10, or pass restore_step=10."), last


@pytest.mark.parametrize("part", ["state/_METADATA", "state/manifest.ocdbt", "state", "meta",
                                  "everything"])
def test_a_partly_deleted_checkpoint_is_the_one_error_naming_what_is_missing(
    written, tmp_path, part
):
    """What a delete (the rotation's, a rollback's) or a copy cut short leaves: a listed step with
    parts missing."""
    directory = tmp_path / "ckpt"
    shutil.copytree(written, directory)
    step = directory / "20"
    if part == "everything":  # all but orbax's top-level files
        for item in ("meta", "state"):
            shutil.rmtree(step / item)
    elif (step / part).is_dir():
        shutil.rmtree(step / part)
    else:
        (step / part).unlink()
    shown = {"state": "state/_METADATA", "everything": "meta/metadata"}.get(part, part)
    if part == "meta":
        shown = "meta/metadata"
    with jd.training.Checkpointer(directory) as ckpt, pytest.raises(
            jd.training.CheckpointCorruptedError,
            match=rf"checkpoint 20 .*\(.*{re.escape(shown)}.* missing: partly written or partly "
                  r"deleted\): delete "
                  rf".*20 to resume from 10, or pass step=10\.$"):
        trainer().restore(ckpt, batch=SAMPLE)


@pytest.mark.parametrize("part", ["meta", "state/ocdbt.process_0"])
def test_fit_names_a_checkpoint_missing_an_item_or_a_process_part_as_damage(
    written, tmp_path, part
):
    """Not "a checkpoint jaxdist.training did not write" (a missing ``meta``), nor orbax's bare
    ``Exception`` from tensorstore's read (a process's database gone): damage, with the step that
    resumes."""
    directory = tmp_path / "ckpt"
    shutil.copytree(written, directory)
    shutil.rmtree(directory / "20" / part)
    shown = "meta/metadata" if part == "meta" else part
    with pytest.raises(jd.training.CheckpointCorruptedError,
                       match=rf"^checkpoint 20 in .*\({re.escape(shown)} missing: partly written "
                             r"or partly deleted\): "
                             rf"delete .*20 to resume from 10, or pass restore_step=10\.$") as info:
        trainer().fit(data_fn, steps=30, checkpoint_dir=directory, verbose=0)
    assert (info.value.step, info.value.intact_step) == (20, 10)
    # another writer's steps (no jaxdist item) still get the plain orbax advice
    another = tmp_path / "orbax"
    shutil.copytree(written, another)
    for step in ("10", "20"):
        for item in ("meta", "state"):
            shutil.move(another / step / item, another / step / f"default_{item}")
    with pytest.raises(ValueError,
                       match=r"holds a checkpoint at step 20 that jaxdist.training did not write"):
        trainer().fit(data_fn, steps=30, checkpoint_dir=another, verbose=0)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_job_whose_checkpoint_lost_one_process_part_names_it_on_every_process(tmp_path):
    """2 processes (FSDP: each writes its own ``state/ocdbt.process_<i>``); process 1's part of
    checkpoint 6 removed: before, process 1 failed in orbax's words ("Encountered error while
    reading array index") and process 0 was stopped for it; now every process says which part is
    missing and that 3 resumes."""
    worker = str(HERE / "multiprocess" / "damaged_worker.py")
    launch = [*LAUNCH, "-n", "2", "--cpu-devices", "2", "--timeout", "120", worker,
              str(tmp_path / "ckpt")]
    wrote = subprocess.run([*launch, "write"], env=launch_env(), capture_output=True, text=True,
                           timeout=150)
    assert wrote.returncode == 0 and "[1] reached 6" in wrote.stdout, (
        wrote.stdout[-3000:] + wrote.stderr[-3000:]
    )
    part = tmp_path / "ckpt" / "6" / "state" / "ocdbt.process_1"
    assert (part / "manifest.ocdbt").is_file()
    shutil.rmtree(part)
    out = subprocess.run([*launch, "resume"], env=launch_env(), capture_output=True, text=True,
                         timeout=150)
    assert out.returncode == 3, out.stdout[-3000:] + out.stderr[-3000:]
    for process in (0, 1):
        said = [line for line in out.stdout.splitlines()
                if line.startswith(f"[{process}] CheckpointCorrupted")]
        assert said, out.stdout[-3000:]
        assert "(state/ocdbt.process_1 missing: partly written or partly deleted)" in said[0], said
        assert said[0].endswith("resume from 3, or pass restore_step=3."), said
    assert "Encountered error while reading" not in out.stdout + out.stderr


def test_a_damaged_older_checkpoint_names_the_newer_one_that_restores(written, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(written, directory)
    (directory / "10" / "state" / "_METADATA").unlink()
    with jd.training.Checkpointer(directory) as ckpt, pytest.raises(
            jd.training.CheckpointCorruptedError,
            match=r"checkpoint 10 .*there is no older one; the newest checkpoint, 20, restores: "
                  r"pass step=20") as info:
        trainer().restore(ckpt, step=10, batch=SAMPLE)
    assert "empty directory" not in str(info.value) and info.value.newer_intact_step == 20


def test_an_interrupted_rollback_never_brings_the_abandoned_steps_back(tmp_path, monkeypatch):
    """``restore_step=10`` abandons 20 and 30; killed after deleting one of them, the next
    checkpointer on the directory finishes the deletion before it lists the steps, so a plain resume
    starts from 10."""
    state = {"w": np.arange(3.0, dtype=np.float32)}
    with jd.training.Checkpointer(tmp_path) as ckpt:
        for step in (10, 20, 30):
            ckpt.save(step, {"w": state["w"] + step})
    ckpt = jd.training.Checkpointer(tmp_path)
    deleted = []

    def killed_after_one(step):
        if deleted:
            raise KeyboardInterrupt("killed between two deletions")
        deleted.append(step)
        shutil.rmtree(tmp_path / str(step))

    monkeypatch.setattr(ckpt._manager, "delete", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        ckpt.abandon_after(10)
    assert deleted == [30] and sorted(os.listdir(tmp_path)) == [
        ".jaxdist-rollback.json",
        "10",
        "20",
    ]
    with jd.training.Checkpointer(tmp_path) as again:
        assert again.all_steps() == [10]
        restored, meta = again.restore(
            jd.OneDeviceStrategy().mirror({"w": np.zeros(3, np.float32)})
        )
    assert meta["step"] == 10 and restored["w"].tolist() == [10.0, 11.0, 12.0]
    assert sorted(os.listdir(tmp_path)) == ["10"]
