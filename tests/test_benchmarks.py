"""Smoke test of ``benchmarks/loss_scale_overhead.py`` on a layerless toy GPT.

Checks the report's JSON schema and that the atomicity check it reports is
real: every candidate passes it, and a deliberately non-atomic one fails it.
No timing assertions: speed figures live in the benchmark's own output.
"""

import dataclasses
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import _gpt
import loss_scale_overhead as bench

CONFIG = dataclasses.replace(_gpt.GPTConfig.tiny(), num_layers=0)  # 5 leaves: compiles fast

ROW_KEYS = {
  "name": str,
  "description": str,
  "donate_argnums": list,
  "bytes_accessed": float,
  "flops": float,
  "temp_bytes": int,
  "fusions": int,
  "compile_s": float,
  "wall_s_median": float,
  "reads": float,
  "extra_fusions_per_leaf": float,
  "extra_flops": float,
  "wall_ratio": float,
  "meets_target": bool,
}


# optax's adam bias correction computes python-float ** int32 count, which strict
# promotion rejects; the benchmark runs optax as users do.
STANDARD = "standard"


@pytest.fixture(scope="module")
def report() -> dict:
  with jax.numpy_dtype_promotion(STANDARD):
    return json.loads(json.dumps(bench.run(CONFIG, repeats=0)))


def test_report_schema(report):
  params = _gpt.init_params(CONFIG)
  assert report["benchmark"] == "loss_scale_overhead"
  assert report["param_count"] == sum(x.size for x in jax.tree.leaves(params))
  assert report["leaf_count"] == len(jax.tree.leaves(params)) == 5
  assert report["grad_read_bytes"] == 4.0 * report["param_count"]
  assert report["target"] == {"reads": 3.0, "extra_fusions_per_leaf": 1.5}
  names = [row["name"] for row in report["results"]]
  assert names == [c.name for c in bench.make_candidates(CONFIG)]
  assert names[0] == "baseline" and {"jmp", "flax", "mpx", "fused_adamw"} <= set(names)
  for row in report["results"]:
    for key, typ in ROW_KEYS.items():
      assert isinstance(row[key], typ), (row["name"], key, row[key])
    assert row["fusions"] > 0 and row["bytes_accessed"] > 0
  base = report["results"][0]
  assert base["reads"] == 0.0 and base["extra_fusions_per_leaf"] == 0.0
  assert base["atomic"] is None and base["meets_target"] is False


def test_every_candidate_is_atomic(report):
  assert all(row["atomic"] is True for row in report["results"][1:])


def test_atomic_check_catches_a_partial_skip():
  """Zeroing the updates but keeping the advanced adam state is not atomic."""

  def partial(inner, grads, inner_state, params, scale):
    grads = jax.tree.map(lambda g: g * (1.0 / scale), grads)
    ok = bench._all_finite_isfinite(grads)
    updates, new_state = inner.update(grads, inner_state, params)
    return bench._skip_updates(ok, updates), new_state, ok

  def step(params, state, batch):
    scale = state.scale
    loss, grads = jax.value_and_grad(lambda p: loss_fn(p, batch) * scale)(params)
    updates, state = tx.update(grads, state, params)
    return jax.tree.map(jnp.add, params, updates), state, loss

  loss_fn = bench._loss_with_poison(_gpt.make_loss_fn(CONFIG))
  tx = bench._wrapper(_gpt.make_optimizer(), partial)
  cand = bench.Candidate("partial", "", tx.init, step, lambda s: s.inner_state)
  params = _gpt.init_params(CONFIG)
  batch = dict(_gpt.make_batch(CONFIG), loss_mult=jnp.float32(1.0))
  with jax.numpy_dtype_promotion(STANDARD):
    compiled = jax.jit(step).lower(params, tx.init(params), batch).compile()
    atomic, _, _ = bench.check_atomic(cand, compiled, params, batch)
  assert atomic is False
