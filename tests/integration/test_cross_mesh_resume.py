"""A train state saved with orbax on one mesh resumes on another (4 forced CPU devices).

A scanned ``tests/models.LlamaDecoder`` trains 2 steps fully sharded over 4
devices (``{"data": 4}``, ``tests/layouts.llama_specs``, the optimizer state
placed by ``mpx.parallel.state_shardings``). One policy holds every kind of state mpx
keeps: bfloat16 params with float32 masters, delayed-scaling float8 matmuls
(amax histories in the model's ``"fp8_history"`` collection) and dynamic loss
scaling (``loss_scale="torch"``). The first step's loss is inf: the step is
skipped, so the ``LossScaleState`` holds a backed-off scale and a skip count,
and the histories hold the second step's amaxes only.

The train state (params, optimizer state, histories) is saved with orbax on
that mesh and restored, through targets whose ``ShapeDtypeStruct``s carry the
new shardings (params by ``llama_specs``, the optimizer state by
``mpx.parallel.state_shardings``, histories replicated), onto a 2-way FSDP x 2-way
tensor-parallel mesh and onto one device. The tests pin that every leaf comes
back bitwise, with its mpx types, on its new sharding; and that 2 more steps on
the FSDP x TP mesh equal bitwise the same steps from the in-memory state moved
there with ``jax.device_put`` (the checkpoint lost nothing), and the same steps
on the original mesh within the tolerance of another order of additions.

Each layout's step is one XLA compile of about 6 s of CPU time, which sets the
test's time: one policy holding all three kinds of state (rather than, say,
``mixed_float16`` and ``mixed_float8_delayed`` apart) and one continuation mesh
keep it to 2 step compiles.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # subprocesses on forced multi-device CPU meshes: CI runs it

# bfloat16 params (float32 masters), bfloat16 compute, float8 matmuls with amax histories.
POLICY = "params=bfloat16,compute=bfloat16,output=float32,fp8=delayed"
LEARNING_RATE = 1e-3
STEPS = 2  # trained on the original mesh before the save, and again after the restore
TARGETS = ("fsdp2_tp2", "single")
CONTINUED = "fsdp2_tp2"

_SCRIPT = textwrap.dedent(
  """
    import json, pathlib, sys
    import jax, jax.numpy as jnp, numpy as np, optax
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import mpx

    tests_dir, ckpt, spec, lr, steps, continued = sys.argv[1:]
    ckpt, lr, steps = pathlib.Path(ckpt), float(lr), int(steps)
    sys.path.insert(0, tests_dir)
    import layouts, models

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    assert jax.device_count() == 4, jax.devices()
    devices = np.array(jax.devices())
    MESHES = {
        "fsdp4": Mesh(devices, ("data",)),
        "fsdp2_tp2": Mesh(devices.reshape(2, 2), ("data", "model")),
        "single": Mesh(devices[:1], ("data",)),
    }
    policy = mpx.get_policy(spec)
    model = mpx.linen.apply_policy(
        models.LlamaDecoder(vocab_size=64, features=32, num_heads=2, num_layers=2, mlp_hidden=64),
        policy,
    )
    tx = mpx.mixed_precision(optax.adamw(lr), policy, loss_scale="torch")
    key = jax.random.key(0)
    batches = [jax.random.randint(jax.random.fold_in(key, i), (8, 17), 0, 64) for i in range(2 * steps)]
    first_factors = [np.inf] + [1.0] * (steps - 1)  # the first step's loss is inf: skipped


    def fresh():
        variables = model.init(key, batches[0][:, :-1])
        params = variables.pop("params")
        return {"params": params, "opt_state": tx.init(params), **variables}


    # What a fresh run knows before restoring: shapes and dtypes, the state's types included.
    abstract = jax.eval_shape(fresh)


    def split(state):
        collections = {k: v for k, v in state.items() if k not in ("params", "opt_state")}
        return state["params"], state["opt_state"], collections


    def loss_fn(params, collections, tokens, factor):
        logits = model.apply({"params": params, **collections}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean() * factor


    def step(state, tokens, factor):
        params, opt_state, collections = split(state)
        grad_fn = mpx.value_and_grad(loss_fn, opt_state, argnums=(0, 1))
        loss, (grads, observed) = grad_fn(params, collections, tokens, factor)
        with jax.numpy_dtype_promotion("standard"):  # optax's adam as users run it
            updates, opt_state = tx.update(grads, opt_state, params)
        # A skipped step leaves the histories as it leaves the params.
        collections = mpx.fp8.update_fp8_state(collections, observed, opt_state=opt_state)
        params = mpx.apply_updates(params, updates)
        return {"params": params, "opt_state": opt_state, **collections}, loss


    def shardings(mesh):
        param_specs = layouts.llama_specs(abstract["params"], dict(mesh.shape), min_size=256)
        params = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
            abstract["params"], param_specs,
        )
        _, opt_state, collections = split(abstract)
        replicated = NamedSharding(mesh, P())
        return {
            "params": jax.tree.map(lambda x: x.sharding, params),
            "opt_state": mpx.parallel.state_shardings(opt_state, params),
            # The amax histories: a few float32 numbers per matmul, replicated.
            **jax.tree.map(lambda _: replicated, collections),
        }


    def trainer(mesh):
        state_sh = shardings(mesh)
        replicated = NamedSharding(mesh, P())
        jitted = jax.jit(step, in_shardings=(state_sh, NamedSharding(mesh, P("data")), replicated),
                         out_shardings=(state_sh, replicated))

        def train(state, batches, factors):
            losses = []
            for tokens, factor in zip(batches, factors, strict=True):
                state, loss = jitted(state, tokens, jnp.float32(factor))
                losses.append(float(loss))
            return state, losses

        return state_sh, train


    def keystr(path):
        return jax.tree_util.keystr(path)


    def not_bitwise(a, b):
        differ = jax.tree_util.tree_map_with_path(
            lambda path, x, y: None if x.dtype == y.dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
            else keystr(path),
            a, b,
        )
        return jax.tree.leaves(differ)


    def unlike_params(state):
        # FSDP keeps its savings only if the float32 masters are split like their params.
        unlike = jax.tree_util.tree_map_with_path(
            lambda path, m, p: None if m is None or m.sharding.is_equivalent_to(p.sharding, p.ndim) else keystr(path),
            state["opt_state"].inner_state.master_params, state["params"], is_leaf=lambda x: x is None,
        )
        return jax.tree.leaves(unlike)


    # Random weights drawn with numpy (their values do not matter here, and jitting
    # model.init would cost one more compile); empty (zero) amax histories, as init makes them.
    rng = np.random.default_rng(0)


    def draw(path, x):
        name = str(path[-1].key)
        if name == "scale":
            return np.ones(x.shape, x.dtype)
        if name == "bias" or path[0].key != "params":
            return np.zeros(x.shape, x.dtype)
        return (rng.standard_normal(x.shape) / np.sqrt(x.shape[-2])).astype(x.dtype)


    sh4, train4 = trainer(MESHES["fsdp4"])
    start = jax.device_put(
        jax.tree_util.tree_map_with_path(draw, {k: v for k, v in abstract.items() if k != "opt_state"}),
        {k: v for k, v in sh4.items() if k != "opt_state"},
    )
    start["opt_state"] = jax.jit(tx.init, out_shardings=sh4["opt_state"])(start["params"])
    first, _ = train4(start, batches[:1], first_factors[:1])
    saved, _ = train4(first, batches[1:steps], first_factors[1:])
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(ckpt, saved)
        checkpointer.wait_until_finished()
    original, original_losses = train4(saved, batches[steps:], [1.0] * steps)

    metrics = mpx.loss_scale_metrics(saved["opt_state"])
    histories = jax.tree.leaves(split(saved)[2])
    masters = jax.tree.leaves(saved["opt_state"].inner_state.master_params)
    report = {
        "skipped_steps": int(metrics["skipped_steps"]),
        "loss_scale": float(metrics["loss_scale"]),
        "initial_loss_scale": float(mpx.get_loss_scale(start["opt_state"])),
        "history_leaves": len(histories),
        # The skipped step committed no amax: only the good steps' are in the histories.
        "history_committed": sorted({int(np.count_nonzero(np.asarray(h)[..., 1:]) // np.asarray(h)[..., 0].size) for h in histories}),
        "skipped_step_left_histories": not_bitwise(split(first)[2], split(start)[2]) == [],
        "master_dtypes": sorted({str(x.dtype) for x in masters}),
        "masters": len(masters),
        "param_dtypes": sorted({str(x.dtype) for x in jax.tree.leaves(saved["params"])}),
        "sharded_params": sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(saved["params"])),
        "masters_unlike_params": unlike_params(saved),
        "targets": {},
    }
    for target in ("fsdp2_tp2", "single"):
        state_sh, train = trainer(MESHES[target])
        spec = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, state_sh)
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(ckpt, spec)
        misplaced = jax.tree_util.tree_map_with_path(
            lambda path, x, s: None if x.sharding.is_equivalent_to(s, x.ndim) else keystr(path),
            restored, state_sh,
        )
        found = report["targets"][target] = {
            "not_bitwise": not_bitwise(restored, saved),
            "same_types": jax.tree.structure(restored) == jax.tree.structure(saved),
            "state_type": type(restored["opt_state"]).__name__,
            "inner_type": type(restored["opt_state"].inner_state).__name__,
            "misplaced": jax.tree.leaves(misplaced),
            "leaves": len(jax.tree.leaves(saved)),
            "resharded": sum(
                not x.sharding.is_equivalent_to(y.sharding, x.ndim)
                for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), strict=True)
            ),
            "devices": sorted({len(x.sharding.device_set) for x in jax.tree.leaves(restored)}),
            "masters_unlike_params": unlike_params(restored),
        }
        if target != continued:
            continue
        resumed, losses = train(restored, batches[steps:], [1.0] * steps)
        moved, _ = train(jax.device_put(saved, state_sh), batches[steps:], [1.0] * steps)
        weights = lambda s: jax.tree.leaves(s["opt_state"].inner_state.master_params)
        diff = np.concatenate([
            np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).ravel() / lr
            for a, b in zip(weights(resumed), weights(original), strict=True)
        ])
        found.update({
            "resumed_not_bitwise": not_bitwise(resumed, moved),
            "original_not_bitwise": not_bitwise(resumed, original),
            "masters_max_diff_in_lr": float(diff.max()),
            "masters_median_diff_in_lr": float(np.median(diff)),
            "masters_fraction_over_half_lr": float((diff > 0.5).mean()),
            "loss_relative_diff": max(abs(a - b) / abs(b) for a, b in zip(losses, original_losses, strict=True)),
            "scalars_not_bitwise": not_bitwise(
                [x for x in jax.tree.leaves(resumed) if x.ndim == 0],
                [x for x in jax.tree.leaves(original) if x.ndim == 0],
            ),
            # The amaxes of the inputs (lhs), the weights (rhs) and the output gradients (grad).
            "history_relative_diff": {
                kind: max(
                    float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())
                    for (path, a), b in zip(
                        jax.tree_util.tree_leaves_with_path(split(resumed)[2]),
                        jax.tree.leaves(split(original)[2]), strict=True,
                    )
                    if path[-1].key == kind
                )
                for kind in ("lhs", "rhs", "grad")
            },
        })
    print(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  # Added to conftest.py's XLA_FLAGS, whose LLVM setting cuts the compile time by a third.
  # XLA:CPU's older elemental emitters compile this step in half the CPU time of its
  # fusion emitters (6-7 s instead of 11-12 s per layout, measured with jax 0.10.2); every
  # comparison here is between runs of the same process, so the emitter does not matter.
  flags = " ".join(
    [
      os.environ.get("XLA_FLAGS", ""),
      "--xla_force_host_platform_device_count=4",
      "--xla_cpu_use_fusion_emitters=false",
    ]
  )
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  tests_dir = pathlib.Path(__file__).resolve().parents[1]
  ckpt = tmp_path_factory.mktemp("orbax") / "ckpt"
  argv = [str(tests_dir), str(ckpt), POLICY, str(LEARNING_RATE), str(STEPS), CONTINUED]
  result = subprocess.run(
    [sys.executable, "-c", _SCRIPT, *argv], env=env, capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_saved_state_holds_a_skipped_step_masters_and_histories(report):
  # The inf step was skipped: the scale backed off once, the skip is counted...
  assert report["skipped_steps"] == 1
  assert report["loss_scale"] == report["initial_loss_scale"] / 2
  # ...and left the histories as they were: each committed the good step's amax only.
  assert report["skipped_step_left_histories"]
  assert report["history_committed"] == [1]
  # lhs, rhs and grad of 6 float8 matmuls: qkv, out, gate, up, down (scanned) and the head.
  assert report["history_leaves"] == 18
  # Float32 masters of the 9 bfloat16 params (the norm scales stay float32, without one).
  assert report["param_dtypes"] == ["bfloat16", "float32"]
  assert report["master_dtypes"] == ["float32"] and report["masters"] == 9
  assert report["sharded_params"] == 7  # the 6 kernels and the embedding, over 4 devices


def test_masters_are_sharded_like_their_params(report):
  # mpx.parallel.state_shardings once replicated every master when some param had none.
  assert report["masters_unlike_params"] == []
  for target in TARGETS:
    assert report["targets"][target]["masters_unlike_params"] == [], target


@pytest.mark.parametrize("target", TARGETS)
def test_every_leaf_restores_bitwise_with_its_mpx_types(report, target):
  found = report["targets"][target]
  assert found["not_bitwise"] == []
  assert found["same_types"]  # the whole tree structure, NamedTuple types included
  assert (found["state_type"], found["inner_type"]) == ("LossScaleState", "MasterParamsState")


@pytest.mark.parametrize("target", TARGETS)
def test_every_leaf_lands_on_its_new_sharding(report, target):
  found = report["targets"][target]
  assert found["misplaced"] == []
  if target == "single":
    assert found["devices"] == [1] and found["resharded"] == found["leaves"]
  else:  # the 7 sharded params, their masters and both moments change layout
    assert found["devices"] == [4] and found["resharded"] == 7 * 4


def test_training_resumes_from_the_checkpoint_as_from_the_state_moved_in_memory(report):
  # The same program on bitwise the same inputs: the checkpoint lost nothing.
  assert report["targets"][CONTINUED]["resumed_not_bitwise"] == []


def test_training_resumes_on_the_new_mesh_as_on_the_original_within_rounding(report):
  found = report["targets"][CONTINUED]
  # Not bitwise: 2 devices of a tensor-parallel pair sum each fan-in layer's partial
  # products, and the FSDP gradients are reduced over 2 devices instead of 4, so the
  # bfloat16 additions run in another order.
  assert found["original_not_bitwise"]
  # The loss scale, its counters and adam's count agree exactly: no step was skipped.
  assert found["scalars_not_bitwise"] == []
  # The logits come out of float8 matmuls in bfloat16: within two bfloat16 roundings.
  assert found["loss_relative_diff"] <= 2**-7
  # A rounding that differs can flip the float8 rounding of an activation (one e4m3 step,
  # 2**-3) or of an output gradient (e5m2, 2**-2): the amaxes agree within one step.
  history = found["history_relative_diff"]
  assert history["lhs"] <= 2**-3 and history["rhs"] <= 2**-3 and history["grad"] <= 2**-2
  # Adam divides each gradient by its own size: gradients a few roundings apart move a
  # master by a few hundredths of a step, but a gradient near zero can flip its sign.
  # In its first steps adam moves a weight by at most 1.0013 lr (Cauchy-Schwarz on its
  # moments with the bias corrections): two runs stay within 2 lr per step everywhere.
  assert found["masters_max_diff_in_lr"] <= 2.01 * STEPS
  assert found["masters_median_diff_in_lr"] <= 0.25
  assert found["masters_fraction_over_half_lr"] <= 0.1
