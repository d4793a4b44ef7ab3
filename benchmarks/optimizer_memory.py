"""Bytes per parameter of every optimizer layout, and its loss gap on the demo's scenario.

For each layout of ``docs/memory.md`` (adamw in every row):

* **bytes per parameter**: ``nbytes`` of the params plus the optimizer state,
  from the arrays ``tx.init`` builds for the demo's model, divided by the
  parameter count; once over the leaves of at least ``--min-size`` (4096)
  elements only (the params and everything the state keeps for them: tiny
  leaves such as norm scales and biases stay float32 under 8-bit moments),
  and once over the whole model (scalars such as the loss scale included);
* **training**: the demo's character-level transformer (``python -m
  mpx.demo``: its model, data, seed and adamw schedule, the optimizer behind
  its all-reduce stand-in), trained under the layout; the final validation
  loss and its gap to float32 adamw. Layouts (b) and (d) are also compared
  step by step: whether each step's bfloat16 params are bitwise those of
  layout (b).

Usage::

  python benchmarks/optimizer_memory.py            # the demo's default run (300 steps)
  python benchmarks/optimizer_memory.py --smoke    # bytes from shapes; 2 rows of the --quick
                                                   # model trained for 3 steps

Writes ``benchmarks/results/optimizer_memory.json`` (``optimizer_memory_smoke.json``
with ``--smoke``; ``--out`` for another path).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from harness import results

import mpx
import mpx.demo as demo
from mpx.demo._settings import Data

BF16 = "params=bfloat16,compute=bfloat16,output=float32"
Wrap = Callable[[optax.GradientTransformation], optax.GradientTransformation]


def _moments(state_dtype: str) -> Wrap:
  return lambda inner: mpx.with_state_dtype(inner, state_dtype=state_dtype)


def _plain(policy: str, moments: str | None = None) -> Wrap:
  return lambda i: mpx.mixed_precision(_moments(moments)(i) if moments else i, policy)


def _kahan(moments: str | None = None) -> Wrap:
  return lambda i: mpx.mixed_precision(
    mpx.with_kahan_summation(_moments(moments)(i) if moments else i), BF16, master_dtype=None
  )


def _rounding(moments: str | None = None) -> Wrap:
  return lambda i: mpx.mixed_precision(
    mpx.with_stochastic_rounding(_moments(moments)(i) if moments else i, key=jax.random.key(0)),
    BF16,
    master_dtype=None,
  )


def _remainder(moments: str | None = None) -> Wrap:
  return lambda i: mpx.mixed_precision(
    mpx.with_master_params(_moments(moments)(i) if moments else i, remainder=True),
    BF16,
    master_dtype=None,
  )


@dataclasses.dataclass(frozen=True)
class Layout:
  name: str
  policy: str
  wrap: Wrap
  smoke: bool = False


LAYOUTS = (
  Layout("fp32 training", "float32", _plain("float32"), smoke=True),
  Layout("(a) f32 params, bf16 compute", "mixed_bfloat16", _plain("mixed_bfloat16")),
  Layout("(a) + bf16 moments", "mixed_bfloat16", _plain("mixed_bfloat16", "bfloat16")),
  Layout("(a) + int8 moments", "mixed_bfloat16", _plain("mixed_bfloat16", "int8")),
  Layout("(a) + fp8 moments", "mixed_bfloat16", _plain("mixed_bfloat16", "float8_e4m3fn")),
  Layout("(b) bf16 params + f32 masters", BF16, _plain(BF16)),
  Layout("(b) + bf16 moments", BF16, _plain(BF16, "bfloat16")),
  Layout("(c) bf16 + Kahan", BF16, _kahan()),
  Layout("(c) bf16 + Kahan, bf16 moments", BF16, _kahan("bfloat16")),
  Layout("(c) bf16 + stoch. rounding", BF16, _rounding()),
  Layout("(c) bf16 + stoch. rounding, bf16 moments", BF16, _rounding("bfloat16")),
  Layout("(d) bf16 + remainder masters", BF16, _remainder()),
  Layout("(e) remainder masters + int8 moments", BF16, _remainder("int8"), smoke=True),
  Layout("(e) remainder masters + fp8 moments", BF16, _remainder("float8_e4m3fn")),
)

REFERENCE = "(b) bf16 params + f32 masters"
"""The layout whose params the remainder layouts are compared with, bit for bit."""


def _inner(settings: demo.Settings) -> optax.GradientTransformation:
  """The demo's optimizer inside ``mpx.mixed_precision``: all-reduce stand-in, then adamw."""
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=settings.learning_rate,
    warmup_steps=max(1, settings.steps // 10),
    decay_steps=max(2, settings.steps),
    end_value=settings.learning_rate / 10,
  )
  return optax.chain(optax.scale(float(settings.mirrored_devices)), optax.adamw(schedule))


def _nbytes(tree: Any) -> int:
  return sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


_INITS: dict[str, tuple[Any, Any]] = {}


def _model_and_params(policy: str, settings: demo.Settings, data: Data) -> tuple[Any, Any]:
  """The demo's model under ``policy`` and its initial params, as ``python -m mpx.demo`` builds them.

  ``mpx.linen.apply_policy`` samples the params in float32 and stores them in the policy's param
  dtype, except the LayerNorm scales and biases, which stay float32.
  """
  if policy not in _INITS:  # one compiled init per policy (one settings and data per run)
    model = mpx.linen.apply_policy(demo.CharTransformer(settings.model), policy)
    params = settings.jit(model.init)(jax.random.key(settings.seed), data.train[0, :, :-1])
    _INITS[policy] = model, params["params"]
  return _INITS[policy]


def _train_param_count(settings: demo.Settings) -> int:
  model = demo.CharTransformer(settings.model)
  tokens = jax.ShapeDtypeStruct((1, settings.model.max_len), jnp.int32)
  return sum(x.size for x in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0), tokens)))


def bytes_per_param(
  layout: Layout, params: Any, min_size: int, *, concrete: bool = True
) -> dict[str, float]:
  """Params plus optimizer state per parameter: the large leaves alone, and the whole model.

  ``concrete``: from the arrays ``tx.init`` builds; otherwise from their shapes and dtypes
  (``jax.eval_shape``, the same figures without compiling: the smoke run).
  """
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  large = {jax.tree_util.keystr(p): x for p, x in flat if x.size >= min_size}
  out = {}
  for key, tree in (("large_leaves", large), ("whole_model", params)):
    init = layout.wrap(optax.adamw(1e-3)).init
    state = jax.jit(init)(tree) if concrete else jax.eval_shape(init, tree)
    count = sum(x.size for x in jax.tree.leaves(tree))
    out[f"{key}_params"] = _nbytes(tree) / count
    out[f"{key}_opt_state"] = _nbytes(state) / count
    out[f"{key}_total"] = (_nbytes(tree) + _nbytes(state)) / count
  out["large_leaf_share"] = sum(x.size for x in large.values()) / sum(
    x.size for x in jax.tree.leaves(params)
  )
  return out


def _fingerprint(params: Any) -> jax.Array:
  """The params' bits folded into one uint32 per leaf: equal iff (almost surely) bitwise equal."""
  out = []
  for x in jax.tree.leaves(params):
    bits = jax.lax.bitcast_convert_type(x, {2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize])
    bits = bits.astype(jnp.uint32).reshape(-1)
    weights = jnp.arange(1, bits.size + 1, dtype=jnp.uint32) * jnp.uint32(2654435761)
    out.append(jnp.sum(bits * weights, dtype=jnp.uint32))
  return jnp.stack(out)


def train(layout: Layout, settings: demo.Settings, data: Data) -> dict[str, Any]:
  """Trains the demo's model under ``layout``: its losses and per-step param fingerprints."""
  model, params = _model_and_params(layout.policy, settings, data)
  tx = layout.wrap(_inner(settings))
  opt_state = tx.init(params)
  global_tokens = float(settings.global_batch_tokens)

  def objective(p: Any, windows: jax.Array) -> tuple[jax.Array, jax.Array]:
    logits = model.apply({"params": p}, windows[:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:])
    return losses.sum() / global_tokens, losses.mean()

  def step(carry: Any, windows: jax.Array) -> tuple[Any, Any]:
    params, opt_state = carry
    (_, loss), grads = mpx.value_and_grad(objective, opt_state, has_aux=True)(params, windows)
    with jax.numpy_dtype_promotion("standard"):  # optax's adam: python float ** int32 count
      updates, opt_state = tx.update(grads, opt_state, params)
    params = mpx.apply_updates(params, updates)
    return (params, opt_state), (loss, _fingerprint(params))

  @settings.jit
  def run(params: Any, opt_state: Any) -> Any:
    (params, _), (losses, prints) = jax.lax.scan(step, (params, opt_state), jnp.asarray(data.train))
    val = objective(params, jnp.asarray(data.valid))[1]
    return params, losses, prints, val

  start = time.perf_counter()
  params, losses, prints, val = jax.block_until_ready(run(params, opt_state))
  return {
    "seconds": time.perf_counter() - start,
    "val_loss": float(val),
    "last20_train_loss": float(np.mean(np.asarray(losses)[-20:])),
    "fingerprints": np.asarray(prints),
  }


def _bitwise_steps(prints: np.ndarray, reference: np.ndarray) -> int:
  """Steps, from the first, after which the params equal the reference's bit for bit."""
  same = np.all(prints == reference, axis=1)
  return int(np.argmin(same)) if not same.all() else len(same)


def main() -> None:
  parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
  parser.add_argument("--smoke", action="store_true", help="tiny model, few steps, some rows")
  parser.add_argument("--steps", type=int, default=None, help="training steps (default: demo's)")
  parser.add_argument("--min-size", type=int, default=4096, help="smallest leaf counted")
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  settings = demo.QUICK_SETTINGS if args.smoke else demo.DEFAULT_SETTINGS
  steps = args.steps or (3 if args.smoke else settings.steps)
  settings = dataclasses.replace(settings, steps=steps)
  data = demo.make_data(settings, demo.load_corpus())
  demo_param_count = _train_param_count(settings)
  rows: dict[str, dict[str, Any]] = {}
  for layout in LAYOUTS:
    policy = mpx.get_policy(layout.policy)
    if args.smoke:  # shapes and dtypes only: no compiled init for the rows not trained
      model = mpx.linen.apply_policy(demo.CharTransformer(settings.model), layout.policy)
      tokens = jax.ShapeDtypeStruct(data.train[0, :, :-1].shape, jnp.int32)
      params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
    else:
      params = _model_and_params(layout.policy, settings, data)[1]
    row = bytes_per_param(layout, params, args.min_size, concrete=not args.smoke)
    rows[layout.name] = {"policy": str(policy), **row, "trained": layout.smoke or not args.smoke}
    if rows[layout.name]["trained"]:
      rows[layout.name].update(train(layout, settings, data))
      print(f"  {layout.name}: {rows[layout.name]['seconds']:.1f} s", flush=True)

  ref_val = rows["fp32 training"]["val_loss"]
  ref_prints = rows[REFERENCE].get("fingerprints")
  for name, row in rows.items():
    if not row["trained"]:
      continue
    row["val_gap_to_fp32"] = row["val_loss"] - ref_val
    remainder = name.startswith("(d)") or name == REFERENCE
    row["steps_bitwise_equal_to_b"] = (
      _bitwise_steps(row["fingerprints"], ref_prints)
      if remainder and ref_prints is not None
      else None
    )
  header = (
    f"{'layout':42s} {'B/param':>8s} {'(model)':>8s} {'val loss':>9s} {'gap':>7s} {'= (b)':>6s}"
  )
  print(header)
  for name, r in rows.items():
    trained = ""
    if r["trained"]:
      same = r["steps_bitwise_equal_to_b"]
      same = "" if same is None else str(same)
      trained = f"{r['val_loss']:9.4f} {r['val_gap_to_fp32']:+7.4f} {same:>6s}"
    print(f"{name:42s} {r['large_leaves_total']:8.3f} {r['whole_model_total']:8.3f} {trained}")
  for r in rows.values():
    r.pop("fingerprints", None)
  out = args.out or (f"benchmarks/results/optimizer_memory{'_smoke' if args.smoke else ''}.json")
  report = {
    **results.header("optimizer_memory"),
    "settings": {
      "steps": steps,
      "smoke": args.smoke,
      "min_size": args.min_size,
      "param_count": demo_param_count,
    },
    "rows": rows,
  }
  path = pathlib.Path(out)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(report, indent=2))
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
