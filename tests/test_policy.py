"""Tests for mpx.Policy and mpx.get_policy: the grammar, presets, and static use under jit."""

import dataclasses
import types

import chex
import hypothesis
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from hypothesis import strategies as st

import mpx
from mpx._src import policy as policy_lib
from mpx._src import recipe as recipe_lib

F32, BF16, F16, F64 = (np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64))
FAST = hypothesis.settings(max_examples=40, deadline=None, derandomize=True)

# Every spelling of every dtype name get_policy documents.
SPELLINGS = {
  F32: ("float32", "f32", "full", "single", "fp32"),
  BF16: ("bfloat16", "bf16"),
  F16: ("float16", "f16", "half", "fp16"),
  F64: ("float64", "f64", "double", "fp64"),
}


@pytest.mark.parametrize(
  ("spec", "expected"),
  [
    ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
    ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
    ("params=f32,c=f16,output=f32", (F32, F16, F32)),
    ("o=f32,c=f16,p=bf16", (BF16, F16, F32)),
    # Left-out compute defaults to params, left-out output to compute.
    ("p=f32,c=bf16", (F32, BF16, BF16)),
    ("p=f16", (F16, F16, F16)),
    ("params=bf16,output=f32", (BF16, BF16, F32)),
    # A bare dtype name means all three dtypes.
    ("bf16", (BF16, BF16, BF16)),
    ("full", (F32, F32, F32)),
    ("single", (F32, F32, F32)),
    ("f64", (F64, F64, F64)),
    # half is float16 on every platform (jmp picks bfloat16 on TPU).
    ("half", (F16, F16, F16)),
    ("p=half", (F16, F16, F16)),
    # Case and surrounding whitespace are ignored.
    ("  P = F32 ,  C=BF16,O =Float32  ", (F32, BF16, F32)),
    ("\tHALF\n", (F16, F16, F16)),
    ("Mixed_Float16", (F32, F16, F32)),
    # The presets.
    ("float32", (F32, F32, F32)),
    ("mixed_bfloat16", (F32, BF16, F32)),
    ("mixed_float16", (F32, F16, F32)),
    ("bfloat16", (BF16, BF16, BF16)),
    ("float16", (F16, F16, F16)),
  ],
)
def test_get_policy_parses_the_grammar(spec, expected):
  policy = mpx.get_policy(spec)
  got = (policy.param_dtype, policy.compute_dtype, policy.output_dtype)
  assert got == expected
  assert all(isinstance(d, np.dtype) for d in got), "fields must be normalised to np.dtype"


def test_presets_table_is_what_the_docs_say():
  assert set(policy_lib.PRESETS) == {
    "float32",
    "mixed_bfloat16",
    "mixed_float16",
    "bfloat16",
    "float16",
    "mixed_float8",
    "mixed_float8_delayed",
    "mixed_float8_rowwise",
    "mixed_mxfp8",
    "mixed_float8_blockwise",
  }


@pytest.mark.parametrize("preset", sorted(policy_lib.PRESETS))
def test_str_of_every_preset_parses_back(preset):
  policy = mpx.get_policy(preset)
  assert str(policy) == policy_lib.PRESETS[preset]
  assert mpx.get_policy(str(policy)) == policy


def test_str_format():
  policy = mpx.Policy(jnp.float32, jnp.bfloat16, jnp.float16)
  assert str(policy) == "params=float32,compute=bfloat16,output=float16"


dtype_st = st.sampled_from(list(SPELLINGS))


@FAST
@hypothesis.given(dtype_st, dtype_st, dtype_st)
def test_str_parses_back_for_any_triple(p, c, o):
  policy = mpx.Policy(p, c, o)
  assert mpx.get_policy(str(policy)) == policy
  assert mpx.get_policy(str(policy)) is not policy


@st.composite
def _spelled_spec(draw):
  """A jmp-grammar string with random key spellings, order, case and spacing."""
  dtypes = {field: draw(dtype_st) for field in ("param", "compute", "output")}
  keys = {"param": ("params", "p"), "compute": ("compute", "c"), "output": ("output", "o")}
  fields = draw(st.permutations(["param", "compute", "output"]))
  space = st.sampled_from(["", " ", "  ", "\t"])
  parts = []
  for field in fields:
    key = draw(st.sampled_from(keys[field]))
    name = draw(st.sampled_from(SPELLINGS[dtypes[field]]))
    text = f"{draw(space)}{key}{draw(space)}={draw(space)}{name}{draw(space)}"
    parts.append(draw(st.sampled_from([text, text.upper(), text.title()])))
  return ",".join(parts), dtypes


@FAST
@hypothesis.given(_spelled_spec())
def test_any_spelling_of_a_full_spec_parses(spec_and_dtypes):
  spec, dtypes = spec_and_dtypes
  policy = mpx.get_policy(spec)
  assert policy == mpx.Policy(dtypes["param"], dtypes["compute"], dtypes["output"])


# jmp's dtype names (jmp/_src/policy.py): every one of them, spelled as jmp spells it.
JMP_NAMES = (
  "bf16",
  "bfloat16",
  "f16",
  "float16",
  "half",
  "full",
  "f32",
  "float32",
  "f64",
  "float64",
)
JMP_KEYS = (("p", "params"), ("c", "compute"), ("o", "output"))


@st.composite
def _jmp_string(draw):
  """A string jmp accepts: any subset and order of keys, long or short, repeats allowed."""
  if draw(st.booleans()) and draw(st.booleans()):
    return draw(st.sampled_from(JMP_NAMES))  # a bare dtype name
  n = draw(st.integers(1, 4))  # up to 4 parts: a key may repeat (jmp keeps the last)
  parts = []
  for _ in range(n):
    key = draw(st.sampled_from(draw(st.sampled_from(JMP_KEYS))))
    parts.append(f"{key}={draw(st.sampled_from(JMP_NAMES))}")
  return ",".join(parts)


@FAST
@hypothesis.given(_jmp_string())
def test_every_jmp_string_gives_jmp_policy(spec):
  # On CPU jmp's "half" is float16, so every string must agree dtype for dtype.
  theirs = jmp.get_policy(spec)
  ours = mpx.get_policy(spec)
  assert (ours.param_dtype, ours.compute_dtype, ours.output_dtype) == tuple(
    np.dtype(d) for d in (theirs.param_dtype, theirs.compute_dtype, theirs.output_dtype)
  ), spec


@pytest.mark.parametrize(
  ("spec", "expected"),
  [
    ("c=bf16", "params=float32,compute=bfloat16,output=bfloat16"),
    ("compute=half", "params=float32,compute=float16,output=float16"),
    ("o=f32", "params=float32,compute=float32,output=float32"),
    ("c=bf16,o=f32", "params=float32,compute=bfloat16,output=float32"),
    ("p=f16,p=f32,c=bf16", "params=float32,compute=bfloat16,output=bfloat16"),
  ],
)
def test_missing_params_default_to_float32_as_in_jmp(spec, expected):
  assert str(mpx.get_policy(spec)) == expected


def test_policy_is_returned_unchanged():
  policy = mpx.Policy(F32, F16, F32)
  assert mpx.get_policy(policy) is policy


@pytest.mark.parametrize(
  ("jmp_spec", "expected"),
  [
    ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
    ("params=float32,compute=float16,output=float32", (F32, F16, F32)),
    ("bf16", (BF16, BF16, BF16)),
  ],
)
def test_jmp_policy_is_converted(jmp_spec, expected):
  jmp_policy = jmp.get_policy(jmp_spec)
  policy = mpx.get_policy(jmp_policy)
  assert isinstance(policy, mpx.Policy)
  assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == expected
  # The same string means the same policy in both libraries.
  assert mpx.get_policy(jmp_spec) == policy


def test_jmp_policy_constructed_directly():
  jmp_policy = jmp.Policy(param_dtype=jnp.float32, compute_dtype=jnp.float16, output_dtype=F32)
  assert mpx.get_policy(jmp_policy) == mpx.get_policy("mixed_float16")


def test_duck_typed_policy_object():
  duck = types.SimpleNamespace(param_dtype="f32", compute_dtype=jnp.bfloat16, output_dtype=F32)
  assert mpx.get_policy(duck) == mpx.get_policy("mixed_bfloat16")


def test_constructor_normalises_any_dtype_spelling():
  a = mpx.Policy("f32", jnp.bfloat16, np.dtype("float16"))
  b = mpx.Policy(np.float32, "BF16", "half")
  assert a == b
  assert hash(a) == hash(b)
  assert (a.param_dtype, a.compute_dtype, a.output_dtype) == (F32, BF16, F16)


def test_policy_is_frozen():
  policy = mpx.get_policy("mixed_float16")
  with pytest.raises(dataclasses.FrozenInstanceError):
    policy.compute_dtype = F32  # type: ignore[misc]
  assert policy.compute_dtype == F16


def test_policy_is_hashable_and_equal_across_spellings():
  spellings = ["mixed_bfloat16", "p=f32,c=bf16,o=f32", "params=full,compute=bfloat16,o=single"]
  policies = [mpx.get_policy(s) for s in spellings]
  assert len(set(policies)) == 1
  assert {policies[0]: "x"}[policies[2]] == "x"
  assert mpx.get_policy("mixed_float16") != policies[0]
  assert len({mpx.get_policy(p) for p in policy_lib.PRESETS}) == len(policy_lib.PRESETS)


def test_policy_is_a_static_jit_argument():
  traces = []

  def f(policy, x):
    traces.append(policy)
    return policy.cast_to_output(policy.cast_to_compute(x) * 2)

  jf = jax.jit(f, static_argnums=0)
  x = jnp.arange(3, dtype=jnp.float32)
  y = jf(mpx.get_policy("mixed_bfloat16"), x)
  assert y.dtype == F32
  # An equal policy spelled differently hits the cache: no second trace.
  y2 = jf(mpx.get_policy("p=f32,c=bf16,o=f32"), x)
  assert len(traces) == 1
  z = jf(mpx.get_policy("bfloat16"), x)
  assert len(traces) == 2
  assert z.dtype == BF16
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y2))
  np.testing.assert_array_equal(np.asarray(y), [0.0, 2.0, 4.0])


def test_policy_is_never_traced_or_flattened():
  policy = mpx.get_policy("mixed_float16")
  # Not a registered pytree node: tree utilities see it as one opaque object,
  # so its dtypes can never be mapped over or turned into tracers.
  assert jax.tree.leaves(policy) == [policy]
  assert jax.tree.structure(policy).num_nodes == 1
  with pytest.raises(TypeError, match="non-array argument"):
    jax.jit(lambda p, x: p.cast_to_compute(x))(policy, jnp.ones(2))
  # A policy sitting inside a tree that is cast is left alone.
  tree = {"policy": policy, "w": jnp.ones(2)}
  out = mpx.cast_tree(tree, jnp.bfloat16)
  assert out["policy"] is policy


@pytest.mark.parametrize(
  ("replace", "field"),
  [
    (lambda p, new: dataclasses.replace(p, param_dtype=new), "param_dtype"),
    (lambda p, new: dataclasses.replace(p, compute_dtype=new), "compute_dtype"),
    (lambda p, new: p.with_output_dtype(new), "output_dtype"),
  ],
)
@pytest.mark.parametrize("new", ["bf16", jnp.bfloat16, np.dtype("bfloat16")])
def test_replacing_a_dtype_returns_a_copy(replace, field, new):
  policy = mpx.get_policy("float32")
  copy = replace(policy, new)
  assert copy is not policy
  assert getattr(copy, field) == BF16
  assert policy == mpx.get_policy("float32"), "the original must not change"
  others = {f.name for f in dataclasses.fields(policy)} - {field, "fp8"}
  assert all(getattr(copy, f) == F32 for f in others)
  assert copy.fp8 is None


def test_float16_params_are_allowed_without_a_warning():
  # Pure float16 is the paper's failure mode without masters, but it is what
  # with_master_params expects, so parsing it must stay silent (warnings are errors here).
  policy = mpx.get_policy("float16")
  assert policy.param_dtype == F16


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("preset", sorted(policy_lib.PRESETS))
def test_cast_methods_use_the_matching_dtype(preset, use_jit):
  policy = mpx.get_policy(preset)
  tree = {
    "w": jnp.linspace(-2.0, 2.0, 5, dtype=jnp.float32),
    "h": jnp.ones((2,), jnp.bfloat16),
    "step": jnp.zeros((), jnp.int32),
  }

  def casts(t):
    return policy.cast_to_param(t), policy.cast_to_compute(t), policy.cast_to_output(t)

  fn = jax.jit(casts) if use_jit else casts
  for out, dtype in zip(
    fn(tree), (policy.param_dtype, policy.compute_dtype, policy.output_dtype), strict=True
  ):
    chex.assert_trees_all_equal_structs(out, tree)
    assert out["w"].dtype == dtype
    assert out["h"].dtype == dtype
    assert out["step"].dtype == jnp.int32
    expected = np.asarray(tree["w"]).astype(dtype)
    np.testing.assert_array_equal(np.asarray(out["w"]).view(np.uint8), expected.view(np.uint8))


_AXIS_ST = st.text(
  "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_", min_size=1, max_size=8
)


@st.composite
def _recipe(draw):
  return mpx.Fp8Recipe(
    draw(st.sampled_from(["current", "delayed"])),
    history_length=draw(st.integers(1, 4096)),
    reduction=draw(st.sampled_from(["max", "most_recent"])),
    margin=draw(st.integers(0, 40)),
    axis_name=draw(st.none() | _AXIS_ST),
    attention=draw(st.booleans()),
  )


@st.composite
def _policy(draw):
  recipe = draw(st.none() | _recipe())
  compute = draw(st.sampled_from([F32, BF16] if recipe else [F32, BF16, F16, F64]))
  params, output = (draw(st.sampled_from([F32, BF16, F16, F64])) for _ in range(2))
  return mpx.Policy(params, compute, output, fp8=recipe)


@FAST
@hypothesis.given(_policy())
def test_str_of_any_policy_and_recipe_parses_back(policy):
  assert mpx.get_policy(str(policy)) == policy
  if policy.fp8 is not None:
    assert recipe_lib.parse_recipe(str(policy.fp8)) == policy.fp8


@pytest.mark.parametrize(
  "recipe",
  [
    mpx.Fp8Recipe("current", axis_name="Batch"),  # names are case-sensitive in JAX
    mpx.Fp8Recipe("current", history_length=8, reduction="most_recent", margin=2, attention=True),
    mpx.Fp8Recipe("delayed", axis_name="dataParallel", margin=1),
  ],
)
def test_recipe_fields_survive_str(recipe):
  policy = mpx.Policy(F32, BF16, F32, fp8=recipe)
  assert mpx.get_policy(str(policy)) == policy
  assert mpx.get_policy(str(policy)).fp8.axis_name == recipe.axis_name  # pyright: ignore[reportOptionalMemberAccess]


def test_policy_keys_dtypes_and_recipe_words_ignore_case_but_not_the_axis_name():
  policy = mpx.get_policy("P=F32,C=BF16,FP8=Delayed:History=4:Reduction=Most_Recent:axis=Data")
  assert policy.fp8 == mpx.Fp8Recipe("delayed", 4, "most_recent", axis_name="Data")
  assert mpx.get_policy("MIXED_FLOAT8") == mpx.get_policy("mixed_float8")


@pytest.mark.parametrize(
  ("part", "match"),
  [
    ("history=abc", r"history=abc.*whole number"),
    ("margin=1.5", r"margin=1\.5.*whole number"),
    ("history=0", "at least 1"),
    ("axis=", "axis name"),
  ],
)
def test_bad_recipe_values_raise_policy_errors_naming_the_part(part, match):
  with pytest.raises(mpx.PolicyError, match=match):
    mpx.get_policy(f"p=f32,c=bf16,fp8=delayed:{part}")


@pytest.mark.parametrize(
  "kwargs",
  [{"history_length": 2.5}, {"margin": True}, {"axis_name": "a:b"}, {"axis_name": ""}],
)
def test_recipes_that_could_not_be_written_as_a_string_are_refused(kwargs):
  with pytest.raises(mpx.PolicyError):
    mpx.Fp8Recipe("delayed", **kwargs)
