"""Tests for mpx.cast_tree: which leaves change, bit-exact rounding, and JAX transformations."""

import os
import subprocess
import sys
import textwrap
from typing import NamedTuple

import chex
import hypothesis
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import mpx
from mpx._src import tree as tree_lib

F32, BF16, F16 = (np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))
DTYPES = [F32, BF16, F16]
DTYPE_IDS = ["float32", "bfloat16", "float16"]
JIT = pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
TARGET = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)


def _bits(x) -> np.ndarray:
  """The raw bits of a floating array, for bit-for-bit comparisons."""
  x = np.asarray(x)
  return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def _reference(x, dtype) -> np.ndarray:
  # NumPy warns when a value overflows float16; the rounding to inf is what we compare.
  with np.errstate(over="ignore", invalid="ignore"):
    return np.asarray(x).astype(dtype)


def assert_same_bits(actual, expected):
  """Bit-for-bit equality, except that any NaN matches any NaN of the same sign.

  IEEE 754 does not fix NaN payloads across a format conversion, and XLA
  canonicalises them while NumPy truncates them.
  """
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.dtype == expected.dtype and actual.shape == expected.shape
  nan = np.isnan(expected.astype(np.float32))
  np.testing.assert_array_equal(np.isnan(actual.astype(np.float32)), nan)
  np.testing.assert_array_equal(np.signbit(actual[nan]), np.signbit(expected[nan]))
  np.testing.assert_array_equal(_bits(actual)[~nan], _bits(expected)[~nan])


# ---------------------------------------------------------------------------
# Hypothesis: arbitrary nested pytrees of mixed leaves.


class Pair(NamedTuple):
  first: object
  second: object


TYPED_KEYS = [jax.random.key(i) for i in range(2)]
LEGACY_KEYS = [jax.random.PRNGKey(i) for i in range(2)]
SHAPES = hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=3)


def _float_arrays(dtype):
  # Any float32 value (NaN, inf, subnormals included), stored in ``dtype``.
  f32 = hnp.arrays(np.float32, SHAPES, elements=st.floats(width=32))
  return f32.map(lambda a: _reference(a, dtype))


LEAVES = st.one_of(
  # JAX arrays; float64 is left out because jax_enable_x64 is off.
  *(_float_arrays(d).map(jnp.asarray) for d in DTYPES),
  hnp.arrays(np.int32, SHAPES).map(jnp.asarray),
  hnp.arrays(np.bool_, SHAPES).map(jnp.asarray),
  # NumPy arrays and scalars, float64 included: they stay on the host.
  *(_float_arrays(d) for d in (*DTYPES, np.dtype(np.float64))),
  st.floats(width=32).map(np.float32),
  hnp.arrays(np.int64, SHAPES),
  # Python scalars and objects, PRNG keys and None.
  st.integers(-(2**40), 2**40),
  st.booleans(),
  st.floats(),
  st.text(max_size=3),
  st.sampled_from(TYPED_KEYS),
  st.sampled_from(LEGACY_KEYS),
  st.none(),
)
NAMES = st.sampled_from(["params", "Dense_0", "kernel", "bias", "step", "rng"])
TREES = st.recursive(
  LEAVES,
  lambda children: st.one_of(
    st.lists(children, max_size=3),
    st.lists(children, max_size=3).map(tuple),
    st.dictionaries(NAMES, children, max_size=3),
    st.builds(Pair, children, children),
  ),
  max_leaves=8,
)


def _kind(x) -> type:
  for kind in (jax.Array, np.ndarray, np.generic):
    if isinstance(x, kind):
      return kind
  return type(x)


@TARGET
@hypothesis.settings(max_examples=40, deadline=None, derandomize=True)
@hypothesis.given(tree=TREES)
def test_cast_tree_changes_only_floating_array_leaves(tree, dtype):
  out = mpx.cast_tree(tree, dtype)
  assert jax.tree.structure(out) == jax.tree.structure(tree)
  for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(out), strict=True):
    if not tree_lib.is_floating_array(x):
      assert y is x, f"a {type(x).__name__} leaf must be returned unchanged"
      continue
    assert _kind(y) is _kind(x), "NumPy leaves stay NumPy, JAX leaves stay JAX"
    assert y.dtype == dtype
    assert y.shape == x.shape
    if x.dtype == dtype:
      assert y is x
    assert_same_bits(y, _reference(x, dtype))


@TARGET
@hypothesis.settings(max_examples=12, deadline=None, derandomize=True)
@hypothesis.given(tree=TREES)
def test_cast_tree_under_jit_matches_eager(tree, dtype):
  # Only JAX arrays can be jit arguments; the other leaves are closed over.
  leaves, treedef = jax.tree.flatten(tree)
  dynamic = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
  structures = []

  def f(args):
    full = list(leaves)
    for i, x in zip(dynamic, args, strict=True):
      full[i] = x
    out = mpx.cast_tree(jax.tree.unflatten(treedef, full), dtype)
    structures.append(jax.tree.structure(out))
    out_leaves = jax.tree.leaves(out)
    return [out_leaves[i] for i in dynamic]

  got = jax.jit(f)([leaves[i] for i in dynamic])
  assert structures == [treedef]
  for i, y in zip(dynamic, got, strict=True):
    x = leaves[i]
    if tree_lib.is_floating_array(x):
      assert y.dtype == dtype
      assert_same_bits(y, _reference(x, dtype))
    else:
      assert y.dtype == x.dtype
      chex.assert_trees_all_equal(y, x)


# ---------------------------------------------------------------------------
# Rounding: bit-exact expectations the formats guarantee.


@JIT
@hypothesis.settings(max_examples=30, deadline=None, derandomize=True)
@hypothesis.given(x=hnp.arrays(np.float32, (16,), elements=st.floats(width=32)))
def test_float32_bfloat16_float32_round_trip_matches_numpy(x, use_jit):
  def round_trip(v):
    return mpx.cast_tree(mpx.cast_tree(v, jnp.bfloat16), jnp.float32)

  fn = jax.jit(round_trip) if use_jit else round_trip
  got = fn(jnp.asarray(x))
  assert got.dtype == F32
  assert_same_bits(got, x.astype(ml_dtypes.bfloat16).astype(np.float32))


@JIT
@TARGET
def test_random_bit_patterns_round_like_numpy(dtype, use_jit):
  # 2**16 random float32 bit patterns: every exponent, subnormals, inf and NaN.
  bits = np.random.default_rng(0).integers(0, 2**32, size=2**16, dtype=np.uint32)
  x = bits.view(np.float32)
  fn = jax.jit(mpx.cast_tree, static_argnums=1) if use_jit else mpx.cast_tree
  assert_same_bits(fn(jnp.asarray(x), dtype), _reference(x, dtype))
  assert_same_bits(mpx.cast_tree(x, dtype), _reference(x, dtype))


F16_CASES = [
  # (float32 input, float16 bits) -- IEEE binary16, round to nearest, ties to even.
  (2.0**-24, 0x0001),  # the smallest subnormal survives
  (2.0**-25, 0x0000),  # exactly half of it: tie, rounds to even (zero)
  (-(2.0**-25), 0x8000),  # ... keeping the sign
  (3 * 2.0**-25, 0x0002),  # tie between 1 and 2 ulps: rounds to even (2)
  (2.0**-14, 0x0400),  # the smallest normal
  (65504.0, 0x7BFF),  # the largest finite value
  (65519.0, 0x7BFF),  # just below the halfway point: rounds down
  (65520.0, 0x7C00),  # halfway to the next binade: rounds to inf
  (1.0 + 2.0**-10, 0x3C01),  # one ulp above 1 is exact
  (1.0 + 2.0**-11, 0x3C00),  # half an ulp: tie, rounds to 1
  (1.0 + 3 * 2.0**-11, 0x3C02),  # 1.5 ulps: tie, rounds to the even 2 ulps
  (float("inf"), 0x7C00),
  (-0.0, 0x8000),
]
BF16_CASES = [
  (1.0 + 2.0**-7, 0x3F81),  # one ulp above 1 is exact
  (1.0 + 2.0**-8, 0x3F80),  # half an ulp: tie, rounds to 1
  (1.0 + 3 * 2.0**-8, 0x3F82),  # 1.5 ulps: tie, rounds to even
  (2.0**-133, 0x0001),  # the smallest bfloat16 subnormal
  (float(np.finfo(np.float32).max), 0x7F80),  # above the bfloat16 max: inf
  (float(ml_dtypes.finfo(ml_dtypes.bfloat16).max), 0x7F7F),
]


@pytest.mark.parametrize("mode", ["jax-eager", "jax-jit", "numpy"])
@pytest.mark.parametrize(
  ("dtype", "value", "bits"),
  [(F16, v, b) for v, b in F16_CASES] + [(BF16, v, b) for v, b in BF16_CASES],
  ids=[f"f16-{v!r}" for v, _ in F16_CASES] + [f"bf16-{v!r}" for v, _ in BF16_CASES],
)
def test_exact_rounding(dtype, value, bits, mode):
  x = np.array([value], np.float32)
  assert float(x[0]) == value, "the input itself must be exact in float32"
  if mode == "numpy":
    # NumPy leaves are cast on the host, as silently as on the device (warnings are errors).
    got = mpx.cast_tree(x, dtype)
    assert isinstance(got, np.ndarray)
  else:
    fn = jax.jit(mpx.cast_tree, static_argnums=1) if mode == "jax-jit" else mpx.cast_tree
    got = fn(jnp.asarray(x), dtype)
    assert isinstance(got, jax.Array)
  assert got.dtype == dtype
  assert int(_bits(got)[0]) == bits, f"{value!r} -> {hex(int(_bits(got)[0]))}, want {hex(bits)}"


# ---------------------------------------------------------------------------
# One fixed tree of every leaf kind, every target dtype, with and without jit.


def _mixed_tree():
  return {
    "params": {
      "Dense_0": {"kernel": jnp.linspace(-3.0, 3.0, 6, dtype=jnp.float32).reshape(2, 3)},
      "norm": Pair(jnp.full((2,), 0.1, jnp.bfloat16), jnp.full((2,), 1e-3, jnp.float16)),
    },
    "step": jnp.array(7, jnp.int32),
    "mask": jnp.array([True, False]),
    "rng": jax.random.key(1),
    "legacy_rng": jax.random.PRNGKey(1),
    "frozen": None,
  }


@JIT
@TARGET
def test_fixed_tree(dtype, use_jit):
  tree = _mixed_tree()
  fn = jax.jit(mpx.cast_tree, static_argnums=1) if use_jit else mpx.cast_tree
  out = fn(tree, dtype)
  chex.assert_trees_all_equal_structs(out, tree)
  floating = [out["params"]["Dense_0"]["kernel"], *out["params"]["norm"]]
  inputs = [tree["params"]["Dense_0"]["kernel"], *tree["params"]["norm"]]
  for y, x in zip(floating, inputs, strict=True):
    assert y.dtype == dtype
    assert_same_bits(y, _reference(x, dtype))
  for name in ("step", "mask", "legacy_rng"):
    assert out[name].dtype == tree[name].dtype
    np.testing.assert_array_equal(np.asarray(out[name]), np.asarray(tree[name]))
  assert out["rng"].dtype == tree["rng"].dtype
  np.testing.assert_array_equal(jax.random.key_data(out["rng"]), jax.random.key_data(tree["rng"]))
  assert out["frozen"] is None


def test_host_and_python_leaves_are_kept_as_they_are():
  tree = {
    "batch": np.linspace(0, 1, 4, dtype=np.float32),
    "scalar": np.float32(0.1),
    "lr": 0.1,
    "n": 3,
    "name": "dense",
    "policy": mpx.get_policy("mixed_float16"),
  }
  out = mpx.cast_tree(tree, jnp.bfloat16)
  assert type(out["batch"]) is np.ndarray and out["batch"].dtype == BF16
  assert isinstance(out["scalar"], np.generic) and out["scalar"].dtype == BF16
  for name in ("lr", "n", "name", "policy"):
    assert out[name] is tree[name]


def test_nnx_objects_are_returned_unchanged():
  # NNX objects are mutable and shared by reference: a copy would receive the writes
  # (RNG counts, batch statistics) meant for the caller's object.
  rngs = nnx.Rngs(0)
  layer = nnx.Linear(2, 3, rngs=rngs)
  tree = {"layer": layer, "rngs": rngs, "kernel": layer.kernel, "x": jnp.ones(2)}
  out = mpx.cast_tree(tree, jnp.bfloat16)
  for name in ("layer", "rngs", "kernel"):
    assert out[name] is tree[name]
  assert layer.kernel.dtype == F32 and out["x"].dtype == BF16
  state = mpx.cast_tree(nnx.state(layer), jnp.bfloat16)  # holds the layer's own Variables
  assert state["kernel"] is layer.kernel and layer.kernel.dtype == F32


def test_dtype_may_be_a_name():
  out = mpx.cast_tree({"w": jnp.ones(2)}, " BF16 ")
  assert out["w"].dtype == BF16


# ---------------------------------------------------------------------------
# No convert op when the dtype already matches; exactly one when it does not.


@TARGET
def test_no_convert_when_dtype_matches(dtype):
  x = jnp.ones((2, 3), dtype)
  assert mpx.cast_tree(x, dtype) is x

  def same(t):
    return mpx.cast_tree(t, dtype)

  assert jax.make_jaxpr(same)(x).eqns == []
  assert "convert" not in jax.jit(same).lower(x).as_text()

  other = F16 if dtype != F16 else F32

  def different(t):
    return mpx.cast_tree(t, other)

  eqns = jax.make_jaxpr(different)(x).eqns
  assert [e.primitive.name for e in eqns] == ["convert_element_type"]
  assert jax.jit(different).lower(x).as_text().count("stablehlo.convert") == 1


# ---------------------------------------------------------------------------
# Inside grad, vmap and scan.


@JIT
@TARGET
def test_grad_through_casts_returns_param_dtype(dtype, use_jit):
  w = jnp.linspace(-1.7, 2.3, 7, dtype=jnp.float32)

  def loss(params):
    h = mpx.cast_tree(params, dtype)
    # The loss is reduced in float32, as a policy's output_dtype would ask.
    return jnp.sum(mpx.cast_tree(h, jnp.float32)["w"] ** 2)

  grad = jax.grad(loss)
  grads = (jax.jit(grad) if use_jit else grad)({"w": w})
  assert grads["w"].dtype == F32
  # d/dw sum(round(w)**2) = 2 round(w); the cotangent is rounded back through
  # the cast, which is exact because 2 round(w) is representable in ``dtype``.
  expected = 2 * np.asarray(w).astype(dtype).astype(np.float32)
  assert_same_bits(grads["w"], expected)


@JIT
@TARGET
def test_vmap(dtype, use_jit):
  tree = {"w": jnp.linspace(-5.0, 5.0, 12, dtype=jnp.float32).reshape(4, 3), "i": jnp.arange(4)}
  fn = jax.vmap(lambda t: mpx.cast_tree(t, dtype))
  out = (jax.jit(fn) if use_jit else fn)(tree)
  assert out["w"].shape == (4, 3)
  assert out["i"].dtype == tree["i"].dtype
  assert_same_bits(out["w"], _reference(tree["w"], dtype))


@TARGET
def test_scan_keeps_the_carry_dtype(dtype):
  carry = {"w": jnp.linspace(0.1, 0.9, 5, dtype=jnp.float32), "step": jnp.array(0, jnp.int32)}

  def body(c, _):
    h = mpx.cast_tree(c, dtype)  # the int32 step is left alone
    # The arithmetic stays in float32: XLA on CPU may skip rounding the result
    # of a half-precision multiply (xla_allow_excess_precision), but not a cast.
    c = mpx.cast_tree(h, jnp.float32)
    return {"w": c["w"] * 1.5, "step": c["step"] + 1}, None

  out, _ = jax.lax.scan(body, carry, length=4)
  assert out["step"].dtype == jnp.int32 and int(out["step"]) == 4
  expected = np.asarray(carry["w"])
  for _ in range(4):
    expected = expected.astype(dtype).astype(np.float32) * np.float32(1.5)
  assert out["w"].dtype == F32
  assert_same_bits(out["w"], expected)


# ---------------------------------------------------------------------------
# Sharding: needs several devices, so it runs in a fresh interpreter.

_SHARDING_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import mpx

assert jax.device_count() == 8, jax.devices()
mesh = jax.make_mesh((4, 2), ("data", "model"))
split = NamedSharding(mesh, P("data", "model"))
replicated = NamedSharding(mesh, P())
tree = {
    "w": jax.device_put(jnp.arange(64, dtype=jnp.float32).reshape(8, 8) / 7, split),
    "b": jax.device_put(jnp.ones(8, jnp.bfloat16), replicated),
    "step": jax.device_put(jnp.zeros((), jnp.int32), replicated),
}
for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
  for name, fn in (("eager", mpx.cast_tree), ("jit", jax.jit(mpx.cast_tree, static_argnums=1))):
    out = fn(tree, dtype)
    for key in tree:
      got, want = out[key].sharding, tree[key].sharding
      assert got.is_equivalent_to(want, tree[key].ndim), (name, dtype, key, got, want)
    assert out["w"].dtype == dtype and out["step"].dtype == jnp.int32
    expected = np.asarray(tree["w"]).astype(dtype)
    assert (np.asarray(out["w"]).view(np.uint8) == expected.view(np.uint8)).all()
print("sharding preserved")
"""


def test_sharding_is_preserved_on_eight_devices():
  env = {
    **os.environ,
    # Added to conftest.py's XLA_FLAGS, whose LLVM setting cuts the compile time by a third.
    "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8",
    "JAX_PLATFORMS": "cpu",
  }
  result = subprocess.run(
    [sys.executable, "-W", "error", "-c", textwrap.dedent(_SHARDING_SCRIPT)],
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == "sharding preserved"
