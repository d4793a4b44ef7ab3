"""Applying a precision policy to an unmodified Flax linen model.

Mechanism: one method interceptor (``flax.linen.intercept_methods``) is active
while the wrapped model's ``init`` / ``apply`` / ``tabulate`` run. Linen builds
a fresh bound copy of every module on each of those calls (the root is cloned,
modules passed as attributes are cloned on adoption, ``@nn.compact`` and
``setup`` children are constructed anew), and every method of such a copy,
``setup`` included, passes through the interceptor before its body runs. On
the first call of each copy the interceptor resolves the layer's policy (the
keep rules, else its parent's, else the model's) and writes it into the
copy's own Flax knobs, which the body then reads:

* ``dtype`` <- compute dtype, ``param_dtype`` <- param dtype (only fields
  that are ``None`` or a floating dtype; integer "dtype" fields are left);
* ``attention_fn`` <- :func:`mpx.linen.dot_product_attention` (float32 softmax)
  when the layer uses Flax's default and the rules ask for it;
* with ``accumulate_in_float32=True``, ``dot_general`` /
  ``conv_general_dilated`` <- float32-accumulating versions with a custom VJP.

The user's module objects are never mutated, only linen's per-call copies.

Initialisation samples half-precision params in float32 and rounds them to the
param dtype, so layout (b) starts from the float32 run's weights (Flax's
initializers would otherwise draw a different random stream in float16); NNX
models get the same through ``mpx.nnx.apply_policy``'s cast.

The policy overrides every layer's ``dtype``, including ``dtype=jnp.float32``
written in a config default (Flax's ImageNet and LM1B examples); a
deliberate per-layer choice is expressed with :class:`mpx.KeepRules`, the one
way to pin a layer. At a policy boundary (root, or a layer whose policy
differs from its parent's) floating inputs are cast to the layer's compute
dtype and floating outputs to the parent's compute dtype; the root's outputs
go to the output dtype. Integer inputs (token ids) are never touched.

Limits: the wrapper is a plain object, not a Module; wrap the outermost model.
A layer that ignores ``dtype`` (e.g. a hand-written ``x @ w``) computes in
whatever its operands are; ``mpx.audit`` shows such matmuls.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from mpx._src import casting, errors
from mpx._src import dtypes as dtypes_lib
from mpx._src import keep as keep_lib
from mpx._src import policy as policy_lib


def _sampling_policy(policy: policy_lib.Policy) -> policy_lib.Policy:
  # Flax's initializers sample in the param dtype: float16 samples are a different
  # random stream from float32 ones, not their rounding.
  return policy.with_param_dtype("float32") if dtypes_lib.is_half(policy.param_dtype) else policy


def _round_params(result: Any, param_dtypes: dict[tuple[str, ...], np.dtype]) -> Any:
  """Casts each sampled param to its layer's param dtype (the deepest recorded module)."""

  def round_leaf(path: jax.tree_util.KeyPath, leaf: Any) -> Any:
    keys = [str(getattr(k, "key", k)) for k in path]
    if "params" not in keys:
      return leaf
    module_path = tuple(keys[keys.index("params") + 1 : -1])
    while module_path not in param_dtypes and module_path:
      module_path = module_path[:-1]
    dtype = param_dtypes.get(module_path)
    return leaf if dtype is None else casting.cast_tree(leaf, dtype)

  return jax.tree_util.tree_map_with_path(round_leaf, result)


def _path(module: nn.Module) -> str:
  return "/".join(str(p) for p in module.path)


@dataclasses.dataclass(eq=False)
class PolicyModel:
  """A linen model that runs under a precision policy (see the module docstring).

  Made by :func:`apply_policy`; has the model's ``init``, ``init_with_output``,
  ``apply`` and ``tabulate`` and forwards other attributes to it.

  Attributes:
    module: the original, unmodified model.
    policy: the model's policy.
    rules: the keep rules.
    accumulate_in_float32: whether matmuls request float32 accumulation.
  """

  module: nn.Module
  policy: policy_lib.Policy
  rules: keep_lib.KeepRules
  accumulate_in_float32: bool = False

  def __post_init__(self) -> None:
    self._checked_paths = False

  def __getattr__(self, name: str) -> Any:
    if name.startswith("__") or name == "module":
      raise AttributeError(name)
    return getattr(self.module, name)

  def _policy_of(self, module: Any, cache: dict[int, Any], matched: set[str]) -> Any:
    key = id(module)
    if key not in cache:
      own = self.rules.own_policy(module, _path(module), matched)
      if own is None:
        parent = module.parent
        own = self._policy_of(parent, cache, matched) if isinstance(parent, nn.Module) else None
      cache[key] = own or self.policy
    return cache[key]

  def _run(self, fn: Any, args: Any, kwargs: Any, *, initializing: bool = False) -> Any:
    cache: dict[int, Any] = {}
    param_dtypes: dict[tuple[str, ...], np.dtype] = {}
    configured: set[int] = set()
    running: dict[int, int] = {}
    matched: set[str] = set()
    seen: set[str] = set()

    def interceptor(next_fun: Any, f_args: Any, f_kwargs: Any, context: Any) -> Any:
      module = context.module
      key = id(module)
      policy = self._policy_of(module, cache, matched)
      if key not in configured:
        configured.add(key)
        seen.add(_path(module))
        param_dtypes[tuple(module.path)] = policy.param_dtype
        keep_lib.configure_layer(
          module,
          _sampling_policy(policy) if initializing else policy,
          self.rules,
          accumulate_in_float32=self.accumulate_in_float32,
          fields={f.name for f in dataclasses.fields(module)},
          default_attention=nn.dot_product_attention,
        )
      if context.method_name == "setup" or running.get(key):
        return next_fun(*f_args, **f_kwargs)
      parent = module.parent
      if isinstance(parent, nn.Module):
        outer = self._policy_of(parent, cache, matched).compute_dtype
      else:
        outer = policy.output_dtype
      boundary = outer != policy.compute_dtype or not isinstance(parent, nn.Module)
      if boundary:
        f_args, f_kwargs = casting.cast_tree((f_args, f_kwargs), policy.compute_dtype)
      running[key] = running.get(key, 0) + 1
      try:
        out = next_fun(*f_args, **f_kwargs)
      finally:
        running[key] -= 1
      return casting.cast_tree(out, outer) if boundary else out

    with nn.intercept_methods(interceptor):
      result = fn(*args, **kwargs)
    if initializing:
      result = _round_params(result, param_dtypes)
    if not self._checked_paths:
      self._checked_paths = True
      keep_lib.check_paths_matched(self.rules, matched, seen)
    return result

  def init(self, *args: Any, **kwargs: Any) -> Any:
    """``module.init`` under the policy; params come out in the param dtype.

    Half-precision params are sampled in float32 and then rounded, so every
    policy starts from the float32 run's initial weights (to the param
    dtype's rounding), as ``mpx.nnx.apply_policy`` does by casting.
    """
    return self._run(self.module.init, args, kwargs, initializing=True)

  def init_with_output(self, *args: Any, **kwargs: Any) -> Any:
    """``module.init_with_output`` under the policy (params as in :meth:`init`)."""
    return self._run(self.module.init_with_output, args, kwargs, initializing=True)

  def apply(self, *args: Any, **kwargs: Any) -> Any:
    """``module.apply`` under the policy; outputs come out in the output dtype."""
    return self._run(self.module.apply, args, kwargs)

  def tabulate(self, *args: Any, **kwargs: Any) -> str:
    """``module.tabulate`` under the policy (shows the policy's dtypes)."""
    return self._run(self.module.tabulate, args, kwargs)


def apply_policy(
  model: nn.Module | PolicyModel,
  policy: Any,
  *,
  rules: keep_lib.KeepRules | None = None,
  accumulate_in_float32: bool = False,
) -> PolicyModel:
  """Runs an unmodified linen model under a precision policy.

  Every layer computes in ``policy.compute_dtype`` and creates its params in
  ``policy.param_dtype``, except where ``rules`` say otherwise (by default
  normalization layers stay float32 and attention softmax runs in float32);
  floating outputs come back in ``policy.output_dtype``. See the module
  docstring for the mechanism.

  Args:
    model: the linen model (as written, with or without ``dtype`` fields).
    policy: a :class:`mpx.Policy` or anything :func:`mpx.get_policy` accepts.
    rules: keep rules; ``None`` means ``mpx.KeepRules()`` (the defaults).
      Linen takes class and path rules; pin a single layer by its path.
    accumulate_in_float32: make ``Dense``, ``DenseGeneral`` and ``Conv``
      layers request float32 accumulation (see :func:`mpx.accumulate_in_float32`).

  Returns:
    A :class:`PolicyModel` with ``init``, ``apply`` and ``tabulate``.

  Raises:
    PolicyError: ``model`` already has a different policy or rules, or the
      rules hold instance rules (linen clones modules on every call).

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, mpx
    >>> model = mpx.linen.apply_policy(nn.Dense(3), "mixed_float16")
    >>> x = jnp.ones((2, 4))
    >>> params = model.init(jax.random.key(0), x)
    >>> model.apply(params, x).dtype, params["params"]["kernel"].dtype
    (dtype('float32'), dtype('float32'))
  """
  policy = policy_lib.get_policy(policy)
  rules = keep_lib.KeepRules() if rules is None else rules
  if rules.instances:
    raise errors.PolicyError(
      f"Linen modules are cloned on every init/apply, so the instance rules "
      f"{[type(m).__name__ for m, _ in rules.instances]} cannot be matched. Pin those "
      r"layers with a path rule instead, e.g. KeepRules().with_path(r'^Decoder_0/head$', 'float32')."
    )
  if isinstance(model, PolicyModel):
    settings = (model.policy, model.rules, model.accumulate_in_float32)
    if settings == (policy, rules, accumulate_in_float32):
      return model
    raise errors.PolicyError(
      f"This model already runs under the policy {model.policy} (accumulate_in_float32="
      f"{model.accumulate_in_float32}) with its own keep rules; applying {policy} "
      f"(accumulate_in_float32={accumulate_in_float32}) on top would conflict. Apply the "
      "new policy to the original model instead: mpx.linen.apply_policy(model.module, ...)."
    )
  if not isinstance(model, nn.Module):
    raise errors.PolicyError(
      f"mpx.linen.apply_policy needs a flax.linen.Module, got {type(model).__name__}. "
      "For an NNX model use mpx.nnx.apply_policy."
    )
  return PolicyModel(model, policy, rules, accumulate_in_float32)
