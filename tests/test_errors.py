"""Bad inputs: each raises the exact mpx exception with a message that says what and how to fix."""

import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpx
from mpx._src import dtypes as dtypes_lib
from mpx._src import errors
from mpx._src import tree as tree_lib

F32 = jnp.float32
PRESET_LIST = (
  "float32, mixed_bfloat16, mixed_float16, bfloat16, float16, mixed_float8, mixed_float8_delayed"
)
NAME_LIST = "float32, f32, full, single, fp32, bfloat16, bf16, float16, f16, half, fp16"


def _params():
  return {"params": {"Dense_0": {"kernel": jnp.ones((2, 2)), "bias": jnp.zeros(2)}}}


def _grads_with(leaf):
  grads = _params()
  grads["params"]["Dense_0"]["kernel"] = leaf
  return grads


def _without_bias(tree):
  del tree["params"]["Dense_0"]["bias"]
  return tree


def _renamed_kernel(tree):
  tree["params"]["Dense_0"]["w"] = tree["params"]["Dense_0"].pop("kernel")
  return tree


def _check_grads(grads):
  return tree_lib.check_floating_leaves(grads, what="gradients")


def _check_structure(grads, params):
  return tree_lib.check_same_structure(grads, params, names=("gradients", "params"))


def _check_shapes(grads, params):
  return tree_lib.check_same_shapes(grads, params, names=("gradients", "params"))


# (id, thunk, exact exception type, message fragments that must all appear).
BAD_INPUTS: list[tuple[str, Callable[[], Any], type[Exception], tuple[str, ...]]] = [
  ("empty", lambda: mpx.get_policy(""), errors.PolicyError, ("empty string", PRESET_LIST)),
  ("blank", lambda: mpx.get_policy("  \t"), errors.PolicyError, ("empty string",)),
  (
    "unknown_preset_like_word",
    lambda: mpx.get_policy("mixed_bf16"),
    errors.PolicyError,
    ("Unknown precision policy 'mixed_bf16'", PRESET_LIST, NAME_LIST, "p, c, o"),
  ),
  (
    "near_miss_preset",
    lambda: mpx.get_policy("mixed_fp16"),
    errors.PolicyError,
    ("Unknown precision policy 'mixed_fp16'. Did you mean 'mixed_float16'?", PRESET_LIST),
  ),
  (
    "near_miss_dtype_in_spec",
    lambda: mpx.get_policy("p=f32,c=bfloat"),
    errors.PolicyError,
    ("Unknown dtype name 'bfloat'", "Did you mean 'bfloat16'?"),
  ),
  (
    "near_miss_key",
    lambda: mpx.get_policy("p=f32,comput=bf16"),
    errors.PolicyError,
    ("Cannot parse 'comput=bf16'", "Did you mean 'compute'?"),
  ),
  (
    "unknown_bare_dtype",
    lambda: mpx.get_policy("fp8"),
    errors.PolicyError,
    ("Unknown precision policy 'fp8'", NAME_LIST),
  ),
  (
    "integer_dtype_in_spec",
    lambda: mpx.get_policy("p=f32,c=int8"),
    errors.PolicyError,
    ("In the policy 'p=f32,c=int8'", "Unknown dtype name 'int8'", NAME_LIST),
  ),
  (
    "unknown_dtype_in_spec",
    lambda: mpx.get_policy("params=float32,compute=bfloat61"),
    errors.PolicyError,
    ("Unknown dtype name 'bfloat61'", "write 'bf16' for bfloat16"),
  ),
  (
    "semicolon_separator",
    lambda: mpx.get_policy("p=f32;c=bf16"),
    errors.PolicyError,
    ("In the policy 'p=f32;c=bf16'", "'f32;c=bf16'", "Separate the parts with commas"),
  ),
  (
    "space_separator",
    lambda: mpx.get_policy("p=f32 c=bf16"),
    errors.PolicyError,
    ("'f32 c=bf16'", "Separate the parts with commas"),
  ),
  (
    "colon_instead_of_equals",
    lambda: mpx.get_policy("p:f32"),
    errors.PolicyError,
    ("Unknown precision policy 'p:f32'", "'params=<dtype>,compute=<dtype>,output=<dtype>'"),
  ),
  (
    "empty_part",
    lambda: mpx.get_policy("p=f32,,c=bf16"),
    errors.PolicyError,
    ("Cannot parse '' in the policy 'p=f32,,c=bf16'", "params|p, compute|c, output|o"),
  ),
  (
    "trailing_comma",
    lambda: mpx.get_policy("p=f32,"),
    errors.PolicyError,
    ("Cannot parse ''",),
  ),
  (
    "unknown_key",
    lambda: mpx.get_policy("p=f32,grads=f32"),
    errors.PolicyError,
    ("Cannot parse 'grads=f32'", "params|p, compute|c, output|o"),
  ),
  (
    "none_spec",
    lambda: mpx.get_policy(None),
    errors.PolicyError,
    ("from None of type NoneType", "'mixed_bfloat16'", "param_dtype, compute_dtype and output"),
  ),
  ("int_spec", lambda: mpx.get_policy(16), errors.PolicyError, ("from 16 of type int",)),
  (
    "object_missing_attributes",
    lambda: mpx.get_policy(types.SimpleNamespace(param_dtype=F32, compute_dtype=F32)),
    errors.PolicyError,
    ("of type SimpleNamespace", "output_dtype"),
  ),
  (
    "duck_with_integer_dtype",
    lambda: mpx.get_policy(
      types.SimpleNamespace(param_dtype=F32, compute_dtype=jnp.int8, output_dtype=F32)
    ),
    errors.PolicyError,
    ("is not a dtype a precision policy can use", "jnp.bfloat16"),
  ),
  (
    "integer_dtype_for_policy",
    lambda: mpx.Policy(jnp.int32, F32, F32),
    errors.PolicyError,
    ("int32", "is not a dtype a precision policy can use", "jnp.float32"),
  ),
  (
    "complex_dtype_for_policy",
    lambda: mpx.Policy(F32, np.complex64, F32),
    errors.PolicyError,
    ("complex64", "is not a dtype a precision policy can use"),
  ),
  (
    "python_int_as_dtype",
    lambda: mpx.Policy(int, F32, F32),
    errors.PolicyError,
    ("<class 'int'> is not a dtype",),
  ),
  (
    "none_as_dtype",
    lambda: mpx.Policy(F32, None, F32),
    errors.PolicyError,
    ("None is not a dtype a precision policy can use",),
  ),
  (
    "unknown_name_in_with",
    lambda: mpx.get_policy("float32").with_output_dtype("fp8"),
    errors.PolicyError,
    ("Unknown dtype name 'fp8'",),
  ),
  (
    "cast_to_integer_dtype",
    lambda: mpx.cast_tree({"w": jnp.ones(2)}, jnp.int32),
    errors.PolicyError,
    ("int32", "is not a dtype a precision policy can use"),
  ),
  (
    "cast_to_none",
    lambda: mpx.cast_tree({"w": jnp.ones(2)}, None),
    errors.PolicyError,
    ("None is not a dtype",),
  ),
  (
    "parse_dtype_unknown_name",
    lambda: dtypes_lib.parse_dtype("float128"),
    errors.PolicyError,
    ("Unknown dtype name 'float128'", "'half' is float16 on every platform"),
  ),
  (
    "integer_gradient_leaf",
    lambda: _check_grads(_grads_with(jnp.ones((2, 2), jnp.int32))),
    errors.LeafTypeError,
    ("gradients leaf 'params/Dense_0/kernel' has dtype int32", "out of the tree you differentiate"),
  ),
  (
    "bool_gradient_leaf",
    lambda: _check_grads([jnp.ones(1), {"mask": np.ones(2, bool)}]),
    errors.LeafTypeError,
    ("gradients leaf '1/mask' has dtype bool",),
  ),
  (
    "python_object_gradient_leaf",
    lambda: _check_grads(_grads_with("kernel")),
    errors.LeafTypeError,
    ("gradients leaf 'params/Dense_0/kernel' has type str",),
  ),
  (
    "python_float_gradient_leaf",
    lambda: _check_grads({"lr": 0.1}),
    errors.LeafTypeError,
    ("gradients leaf 'lr' has type float",),
  ),
  (
    "prng_key_gradient_leaf",
    lambda: _check_grads({"rng": jax.random.key(0)}),
    errors.LeafTypeError,
    ("gradients leaf 'rng' has dtype key<fry>",),
  ),
  (
    "bare_integer_leaf",
    lambda: tree_lib.check_floating_leaves(np.int32(3), what="updates"),
    errors.LeafTypeError,
    ("updates leaf '<root>' has dtype int32", "every leaf of the updates"),
  ),
  (
    "missing_leaf",
    lambda: _check_structure(_without_bias(_params()), _params()),
    errors.TreeStructureError,
    ("'params/Dense_0/bias' is in the params but not in the gradients", "(1 against 2 leaves)"),
  ),
  (
    "extra_leaf",
    lambda: _check_structure(_params(), _without_bias(_params())),
    errors.TreeStructureError,
    ("'params/Dense_0/bias' is in the gradients but not in the params", "(2 against 1 leaves)"),
  ),
  (
    "different_key",
    lambda: _check_structure(_params(), _renamed_kernel(_params())),
    errors.TreeStructureError,
    (
      "'params/Dense_0/kernel' is in the gradients but not in the params, and "
      "'params/Dense_0/w' is in the params but not in the gradients",
      "Pass the params the gradients were computed from",
    ),
  ),
  (
    "list_against_tuple",
    lambda: _check_structure([jnp.ones(1)], (jnp.ones(1),)),
    errors.TreeStructureError,
    ("the leaf paths agree and the containers differ", "(1 against 1 leaves)"),
  ),
  (
    "shape_mismatch",
    lambda: _check_shapes(_grads_with(jnp.ones(5)), _params()),
    errors.TreeStructureError,
    (
      "gradients leaf 'params/Dense_0/kernel' has shape (5,), but the params leaf "
      "'params/Dense_0/kernel' has shape (2, 2)",
      "Pass the params the gradients were computed from",
    ),
  ),
  (
    "shape_check_reports_structure_first",
    lambda: _check_shapes(_without_bias(_params()), _params()),
    errors.TreeStructureError,
    ("'params/Dense_0/bias' is in the params but not in the gradients",),
  ),
  (
    "traced_scale",
    lambda: jax.jit(lambda s: mpx.static_loss_scale(optax.sgd(1.0), s))(jnp.float32(8.0)),
    errors.ConfigError,
    (
      "scale must be known when the optimizer is built, but it is a traced value",
      "Pass a Python number such as scale=2.0**15",
      "list 'scale' in static_args",
    ),
  ),
  (
    "none_subtree_against_missing",
    lambda: _check_structure({"a": jnp.ones(1), "b": None}, {"a": jnp.ones(1)}),
    errors.TreeStructureError,
    ("containers differ",),
  ),
]


@pytest.mark.parametrize(
  ("thunk", "exc_type", "fragments"), [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input_raises_exact_error(thunk, exc_type, fragments):
  with pytest.raises(exc_type) as info:
    thunk()
  assert type(info.value) is exc_type
  message = str(info.value)
  for fragment in fragments:
    assert fragment in message, f"{fragment!r} not in {message!r}"


def test_there_are_at_least_fifteen_distinct_bad_inputs():
  assert len({b[0] for b in BAD_INPUTS}) == len(BAD_INPUTS) >= 15


@pytest.mark.parametrize(
  ("exc_type", "builtin"),
  [
    (errors.PolicyError, ValueError),
    (errors.ConfigError, ValueError),
    (errors.TreeStructureError, ValueError),
    (errors.LeafTypeError, TypeError),
    (errors.StateError, ValueError),
    (errors.LossScaleDivergedError, FloatingPointError),
  ],
)
def test_every_error_is_an_mpx_error_and_the_natural_builtin(exc_type, builtin):
  assert issubclass(exc_type, mpx.MpxError)
  assert issubclass(exc_type, builtin)
  with pytest.raises(builtin):
    raise exc_type("x")


def test_precision_warning_is_a_user_warning_not_an_error():
  assert issubclass(mpx.PrecisionWarning, UserWarning)
  assert not issubclass(mpx.PrecisionWarning, mpx.MpxError)


def test_policy_error_is_catchable_as_value_error():
  with pytest.raises(ValueError, match="Unknown precision policy"):
    mpx.get_policy("fp4")


def test_public_names_are_the_error_classes():
  assert mpx.PolicyError is errors.PolicyError
  assert mpx.LeafTypeError is errors.LeafTypeError
  assert mpx.TreeStructureError is errors.TreeStructureError
