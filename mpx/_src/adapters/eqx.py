"""The Equinox adapter: a model under a policy is the same module tree, with its layers wrapped.

Equinox layers have no dtype knobs: they compute with whatever arrays they
hold (``self.weight @ x``). So :func:`apply_policy` rebuilds the module tree
out of place (as ``eqx.tree_at`` does): floating params are cast to their
layer's param dtype, and the model, every ``equinox.nn`` layer with params
and every layer whose compute dtype differs from its parent's are wrapped in
a :class:`PolicyLayer`. The model's call casts every param to the compute
dtype as it starts, down to the layers kept in another precision, which cast
their own as their calls start (so a hand-written ``x @ self.w`` computes in
the compute dtype too); a layer whose dtype differs from its parent's casts
its call's inputs and outputs; a float32 ``LayerNorm`` / ``RMSNorm`` in a
half-precision parent runs the lean kernels of ``mpx._src.ops.normalization``;
``eqx.nn.Linear`` / ``eqx.nn.Conv`` under a float8 policy compute their
products through ``mpx._src.adapters.eqx_fp8``. Each layer's policy comes
from the resolver the Flax adapters share (``mpx._src.adapters.layer_policy``),
by Equinox's attribute paths (``layers/3/attention/query_proj``); walking and
casting the tree is ``mpx._src.adapters.eqx_tree``. The wrappers' name
scopes carry the paths, which the audit reads. The user-facing account is
:func:`apply_policy`'s docstring.
"""

from __future__ import annotations

import contextlib
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from mpx._src import casting, errors
from mpx._src import policy as policy_lib
from mpx._src import tree as tree_lib
from mpx._src.adapters import eqx_fp8, eqx_tree, layer_policy
from mpx._src.adapters import keep as keep_lib
from mpx._src.ops import normalization
from mpx._src.scaling import state as loss_scale_state

DEFAULT_KEEP_CLASSES: tuple[type, ...] = (
  eqx.nn.BatchNorm,
  eqx.nn.LayerNorm,
  eqx.nn.RMSNorm,
  eqx.nn.GroupNorm,
)
_LEAN_NORM_KINDS: dict[type, str] = {eqx.nn.LayerNorm: "layer", eqx.nn.RMSNorm: "rms"}


class PolicyLayer(eqx.nn.StatefulLayer):
  """A layer of a model under a precision policy: :func:`mpx.eqx.apply_policy` makes them.

  An ordinary Equinox module holding the layer as ``mpx_layer``; attributes it
  does not have are read from the layer (``wrapper.weight``,
  ``model.blocks[0]``), so code that reaches into the model and
  ``eqx.tree_at(lambda m: m.head.weight, ...)`` keep working. It is stateful
  exactly when the layer is (``eqx.nn.Sequential`` passes an ``eqx.nn.State``
  to it then). A call casts the floating arrays below the wrapper to its
  compute dtype (down to nested wrappers with a boundary, which cast their
  own; inside the model's call this is done once, by the model's wrapper)
  and, with a boundary, the call's floating inputs to the first dtype of
  ``mpx_boundary`` and its floating outputs to the second; ``eqx.nn.State``
  objects are never cast. Its calls run under the name scope of its path.

  Attributes:
    mpx_layer: the wrapped layer.
    mpx_history: a delayed float8 recipe's :class:`mpx.eqx.Fp8History`, or
      ``None``.
    mpx_policy: the layer's policy, as a string.
    mpx_boundary: ``(inner, outer)`` dtype names, or ``None`` for a layer
      that computes in its parent's compute dtype.
    mpx_path: the layer's ``/``-joined path in the model (``""`` for the
      model).
    mpx_scope: the parts of its path below the enclosing wrapper: the name
      scopes of its calls, which the audit reads.
    mpx_lean_norm: ``"layer"`` or ``"rms"`` for a norm computed by mpx's
      lean kernels, else ``None``.
    mpx_contractions: ``"fp8"`` or ``"accumulate_in_float32"`` for a layer
      whose products mpx computes, else ``None``.
    mpx_settings: on the model's wrapper, the policy, accumulation and keep
      rules it was applied with; ``None`` on the others.
  """

  mpx_layer: Any
  mpx_history: eqx_fp8.Fp8History | None
  mpx_policy: str = eqx.field(static=True)
  mpx_boundary: tuple[str, str] | None = eqx.field(static=True)
  mpx_path: str = eqx.field(static=True)
  mpx_scope: tuple[str, ...] = eqx.field(static=True)
  mpx_lean_norm: str | None = eqx.field(static=True, default=None)
  mpx_contractions: str | None = eqx.field(static=True, default=None)
  mpx_settings: tuple[str, str] | None = eqx.field(static=True, default=None)

  def __getattr__(self, name: str) -> Any:
    if name.startswith(("mpx_", "__")):
      raise AttributeError(name)
    return getattr(self.mpx_layer, name)

  def is_stateful(self) -> bool:
    """Whether the wrapped layer takes and returns an ``eqx.nn.State``."""
    layer = self.mpx_layer
    return isinstance(layer, eqx.nn.StatefulLayer) and layer.is_stateful()

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    """Calls the layer under its policy (see the class docstring).

    Args:
      *args: the layer's positional arguments.
      **kwargs: the layer's keyword arguments.

    Returns:
      What the layer returns, floating outputs in the boundary's outer dtype.
    """
    with contextlib.ExitStack() as scopes:
      for part in self.mpx_scope:
        scopes.enter_context(jax.named_scope(part))
      # Inside the model's call, the params were cast with the parent's (a no-op again).
      policy = policy_lib.get_policy(self.mpx_policy)
      layer = eqx_tree.cast_params(self.mpx_layer, policy.compute_dtype)
      if self.mpx_settings is not None:  # The model: histories enter the forward pass here.
        layer = eqx_fp8.max_grad_histories(layer)
      if self.mpx_boundary is None:
        return self._compute(layer, policy, args, kwargs)
      inner, outer = self.mpx_boundary
      if self.mpx_lean_norm is not None:  # On the half-precision input, which it saves.
        out = _lean_norm(layer, self.mpx_lean_norm, args, kwargs, outer)
        if out is not None:
          return out
      out = self._compute(layer, policy, *eqx_tree.cast_data((args, kwargs), inner))
      return eqx_tree.cast_data(out, outer)

  def _compute(self, layer: Any, policy: policy_lib.Policy, args: tuple, kwargs: dict) -> Any:
    if self.mpx_contractions is not None:
      replacements = eqx_fp8.replaced_contractions(
        layer, policy.fp8, self.mpx_contractions == "accumulate_in_float32"
      )
      return eqx_fp8.call(layer, self.mpx_history, replacements, args, kwargs)
    return layer(*args, **kwargs)


def _lean_norm(layer: Any, kind: str, args: tuple, kwargs: dict, dtype: str) -> Any:
  """An ``eqx.nn.LayerNorm`` / ``RMSNorm`` call by the lean kernels, or ``None`` if not covered."""
  kwargs = {k: v for k, v in kwargs.items() if k != "key"}
  state = kwargs.pop("state", args[1] if len(args) == 2 else None)
  if kwargs or not 1 <= len(args) <= 2 or not tree_lib.is_floating_array(args[0]):
    return None
  x = args[0]
  if x.shape != tuple(layer.shape):
    return None  # Equinox's own error explains it.
  axes = tuple(range(x.ndim))
  y, _, _ = normalization.normalize(
    x,
    layer.weight if layer.use_weight else None,
    layer.bias if layer.use_bias else None,
    reduction_axes=axes,
    feature_axes=axes,
    epsilon=layer.eps,
    subtract_mean=kind == "layer",
    fast_variance=False,
    dtype=dtype,
  )
  return y if state is None else (y, state)


def _check_model(model: Any) -> None:
  """Raises a ``PolicyError`` unless ``model`` is an Equinox module."""
  if isinstance(model, eqx.Module):
    return
  kind = type(model).__module__.split(".")[0]
  if kind == "flax":
    raise errors.PolicyError(
      f"mpx.eqx.apply_policy got the Flax module {type(model).__name__}; use "
      "mpx.linen.apply_policy (linen) or mpx.nnx.apply_policy (NNX) for Flax models."
    )
  raise errors.PolicyError(
    f"mpx.eqx.apply_policy needs an equinox.Module (the model), got {type(model).__name__}. "
    "Build the model first (model = MyModel(key=jax.random.key(0))) and pass it; to cast a "
    "pytree of arrays, use policy.cast_to_param or mpx.cast_tree."
  )


def _is_equinox_layer(module: Any) -> bool:
  """Whether ``module`` is an ``equinox.nn`` layer with floating arrays (its calls get a name scope)."""
  if type(module).__module__.split(".")[0] != "equinox":
    return False
  return any(tree_lib.is_floating_array(leaf) for leaf in jax.tree.leaves(module))


class _Builder:
  """Rebuilds a model's module tree under a policy, wrapping the layers that need it."""

  def __init__(
    self,
    model: Any,
    policy: policy_lib.Policy,
    rules: keep_lib.KeepRules,
    accumulate_in_float32: bool,
  ) -> None:
    self.records = {id(m): (path, parent) for path, m, parent in eqx_tree.iter_modules(model)}
    self.accumulate = accumulate_in_float32
    self.layers = layer_policy.LayerPolicies(
      policy,
      rules,
      norm_classes=DEFAULT_KEEP_CLASSES,
      parent_of=lambda m: self.records[id(m)][1],
      path_of=lambda m: layer_policy.join_path(self.records[id(m)][0]),
      lean_norm_kinds=_LEAN_NORM_KINDS,
    )

  def build(
    self,
    module: Any,
    path: tuple[Any, ...],
    base: tuple[Any, ...],
    settings: tuple[str, str] | None = None,
  ) -> Any:
    """The module at ``path`` under its policy; ``base`` is the enclosing wrapper's path.

    ``settings`` are the model's (:func:`_settings`), given for the model only.
    """
    if isinstance(module, PolicyLayer):
      raise errors.PolicyError(
        f"The layer at {layer_policy.join_path(path) or '<root>'} already runs under "
        f"{module.mpx_policy} (mpx.eqx.apply_policy was applied to a part of this model). "
        "Apply the policy once, to the whole model, with all its keep rules."
      )
    policy = self.layers.policy_at(module)
    boundary = self.layers.boundary(module)
    replaced = eqx_fp8.replaced_contractions(module, policy.fp8, self.accumulate)
    wrap = boundary is not None or bool(replaced) or _is_equinox_layer(module)
    new_leaves = []
    flat, treedef = jax.tree_util.tree_flatten_with_path(
      module, is_leaf=lambda x: x is not module and isinstance(x, eqx.Module)
    )
    for key_path, leaf in flat:
      if isinstance(leaf, eqx.Module) and not isinstance(leaf, eqx_tree.OPAQUE):
        leaf = self.build(leaf, path + eqx_tree.path_parts(key_path), path if wrap else base)
      elif not isinstance(leaf, eqx_tree.OPAQUE):
        leaf = casting.cast_tree(leaf, policy.param_dtype)
      new_leaves.append(leaf)
    rebuilt = jax.tree.unflatten(treedef, new_leaves)
    if not wrap:
      return rebuilt
    delayed = bool(replaced) and policy.fp8 is not None and policy.fp8.delayed
    lean = self.layers.lean_norm(module)
    # pyright reads StatefulLayer's abstract `__call__` annotation as a dataclass field.
    return PolicyLayer(  # pyright: ignore[reportCallIssue]
      mpx_layer=rebuilt,
      mpx_history=eqx_fp8.new_history(policy.fp8, rebuilt) if delayed else None,  # pyright: ignore[reportArgumentType]
      mpx_policy=str(policy),
      mpx_boundary=None if boundary is None else (boundary[0].name, boundary[1].name),
      mpx_path=layer_policy.join_path(path),
      mpx_scope=tuple(str(part) for part in path[len(base) :]),
      mpx_lean_norm=lean,
      mpx_contractions=(None if not replaced else "fp8" if policy.fp8 else "accumulate_in_float32"),
      mpx_settings=settings,
    )


def _settings(
  policy: policy_lib.Policy, rules: keep_lib.KeepRules, accumulate: bool, builder: _Builder
) -> tuple[str, str]:
  """What a model was applied with: ``(policy and accumulation, keep rules)``, as strings."""
  instances = [
    (layer_policy.join_path(builder.records[id(m)][0]) if id(m) in builder.records else "?", str(p))
    for m, p in rules.instances
  ]
  rules_text = f"{rules.__class__.__name__}(classes={rules.classes}, paths={rules.paths}, "
  rules_text += f"instances={instances}, norms_in_float32={rules.norms_in_float32}, "
  rules_text += f"softmax_in_float32={rules.softmax_in_float32}, lean_norms={rules.lean_norms})"
  return f"{policy}, accumulate_in_float32={accumulate}", rules_text


def apply_policy(
  model: Any,
  policy: Any,
  rules: keep_lib.KeepRules | None = None,
  *,
  accumulate_in_float32: bool = False,
) -> PolicyLayer:
  """Returns an Equinox model under a precision policy: every layer stored, computed and returned as the policy says.

  Every floating param is stored in ``policy.param_dtype`` and every layer
  computes in ``policy.compute_dtype``, except where ``rules`` give a layer
  a policy of its own: by default ``eqx.nn.LayerNorm``, ``RMSNorm``,
  ``GroupNorm`` and ``BatchNorm`` (:data:`mpx.eqx.DEFAULT_KEEP_CLASSES`)
  keep float32 params and compute, and hand half-precision activations to
  the next layer. Calling the model returns its floating outputs in
  ``policy.output_dtype``.

  How: Equinox layers compute with the arrays they hold, so the module tree
  is rebuilt out of place. Floating params are cast to their layer's param
  dtype; the model, every ``equinox.nn`` layer that holds params and every
  layer whose compute dtype differs from its parent's become a
  :class:`mpx.eqx.PolicyLayer`. The model's call casts its params to the
  compute dtype as it starts (a layer kept in another precision casts its
  own as its call starts), so every layer, hand-written ``x @ self.w``
  included, computes in the compute dtype; a call whose compute dtype
  differs from its parent's casts its floating inputs and outputs. The
  half-precision copy of the params lives for one call of the model (all of
  a stack's, before a ``scan`` over stacked layers). Every floating array of
  a module is a param (Equinox does not tell params from buffers): pin a
  module holding a float buffer with a keep rule.

  * ``eqx.nn.MultiheadAttention`` computes its softmax in float32 itself;
    its projections compute in the compute dtype. For a hand-written
    attention, use :func:`mpx.softmax`.
  * Lean norms (``rules.lean_norms``): a float32 ``LayerNorm`` or
    ``RMSNorm`` in a half-precision parent runs mpx's kernel, the same
    float32 arithmetic whose backward pass keeps the half-precision input
    instead of float32 copies. ``BatchNorm`` runs Equinox's code on the
    float32 cast of its input, with its statistics in the ``eqx.nn.State``.
  * With a float8 policy (``"mixed_float8"``, ``"mixed_float8_delayed"``...),
    ``eqx.nn.Linear`` and ``eqx.nn.Conv`` layers compute their products
    with :func:`mpx.fp8.fp8_dot_general` /
    :func:`mpx.fp8.fp8_conv_general_dilated`, once over the whole batch
    under ``jax.vmap`` (not per example). A delayed recipe keeps an
    :class:`mpx.eqx.Fp8History` in each such layer: split it from the
    params with :func:`mpx.eqx.partition_fp8` and update it with
    :func:`mpx.eqx.update_fp8_state`. With ``accumulate_in_float32``, the
    same layers request float32 accumulation (:func:`mpx.accumulate_in_float32`).

  The result is an ordinary Equinox module: ``eqx.filter_jit``,
  ``eqx.filter_vmap``, ``eqx.filter_grad``, ``eqx.tree_serialise_leaves``
  (the leaves are the model's own, in its order: a float32 checkpoint loads
  into it), ``eqx.nn.State`` and ``eqx.nn.Sequential`` work on it; a
  wrapper reads attributes it lacks from its layer (``model.head.weight``).
  Only calls cast: other methods of the model (``generate``, say) run
  without the policy's boundary casts.

  Args:
    model: an ``equinox.Module``, as written, with float32 params.
    policy: a :class:`mpx.Policy` or anything :func:`mpx.get_policy` accepts.
    rules: keep rules; ``None`` means ``mpx.KeepRules()``. Class, path
      (Equinox's attribute path, ``layers/3/attention/query_proj``; list
      and tuple indices are parts) and instance rules apply; a rule covers
      the matched layer's subtree.
    accumulate_in_float32: make ``eqx.nn.Linear`` and ``eqx.nn.Conv``
      layers request float32 accumulation, forward and backward.

  Returns:
    The model under the policy: a :class:`mpx.eqx.PolicyLayer` wrapping the
    rebuilt model.

  Raises:
    PolicyError: ``model`` is not an Equinox module, or it (or a part of it)
      already runs under other settings. Applying the same settings again
      returns ``model`` unchanged.

  Example:
    >>> import equinox as eqx, jax, jax.numpy as jnp, mpx
    >>> model = mpx.eqx.apply_policy(eqx.nn.Linear(4, 3, key=jax.random.key(0)), "mixed_bfloat16")
    >>> model.weight.dtype, model(jnp.ones(4)).dtype
    (dtype('float32'), dtype('float32'))
  """
  _check_model(model)
  policy = policy_lib.get_policy(policy)
  rules = keep_lib.KeepRules() if rules is None else rules
  if isinstance(model, PolicyLayer) and model.mpx_settings is not None:
    builder = _Builder(model.mpx_layer, policy, rules, accumulate_in_float32)
    settings = _settings(policy, rules, accumulate_in_float32, builder)
    if model.mpx_settings == settings:
      return model
    previous = model.mpx_settings
    change = "it with other keep rules" if previous[0] == settings[0] else settings[0]
    raise errors.PolicyError(
      f"This model already runs under {previous[0]}; applying {change} on top would re-cast "
      "params that the first policy already rounded (half-precision params cannot be "
      "restored to float32 exactly). Apply the policy once, to the float32 model, with all "
      "its keep rules."
    )
  builder = _Builder(model, policy, rules, accumulate_in_float32)
  settings = _settings(policy, rules, accumulate_in_float32, builder)
  wrapped = builder.build(model, (), (), settings=settings)
  builder.layers.warn_unmatched_paths(stacklevel=2)
  return wrapped


def select_state(new_state: Any, state: Any, opt_state: Any) -> Any:
  """The ``eqx.nn.State`` to carry after a step: ``state`` if the loss scale skipped it, else ``new_state``.

  A skipped step (non-finite gradients) leaves the params and the optimizer
  state unchanged; this leaves the model's state (``BatchNorm`` statistics,
  updated by the skipped step's forward pass) unchanged too, bit for bit.
  :func:`mpx.value_and_grad` hands the loss function a copy of each
  ``eqx.nn.State`` argument, so ``state`` is still usable after the call.

  Args:
    new_state: the state the step's forward pass returned.
    state: the state the step started from.
    opt_state: the optimizer state ``tx.update`` returned, holding one
      :class:`mpx.LossScaleState`.

  Returns:
    A state with ``state``'s values where the step was skipped, else
    ``new_state``'s.

  Raises:
    StateError: ``opt_state`` holds no loss-scale state, or several.
  """
  skipped = loss_scale_state.find_loss_scale_state(opt_state).last_step_skipped
  return jax.tree.map(lambda old, new: jnp.where(skipped, old, new), state, new_state)
