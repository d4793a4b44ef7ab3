"""Sharded training: gradient reduction in a narrow dtype, and where the optimizer state lives.

Under ``shard_map`` data parallelism each device holds the gradients of its own
shard of the batch, and one all-reduce averages them. Its bytes are the
gradients' bytes; sending them in the compute dtype (bfloat16, float16) halves
the traffic. The loss scale is already applied (``mpx.value_and_grad``), so
float16 does not flush small gradients, and each device divides by the number
of devices *before* the sum, so no partial sum can exceed the largest local
gradient: the reduction overflows only where a local gradient itself does not
fit the reduction dtype. Unscaling and the finite check then run in float32, in
the loss-scaling transformation, on the reduced gradients, which are the same
on every device, so the skip is global.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mpx._src import dtypes as dtypes_lib
from mpx._src import errors
from mpx._src import tree as tree_lib


def _axis_size(axis_name: Any) -> int:
  try:
    return jax.lax.axis_size(axis_name)
  except NameError as e:
    raise errors.ConfigError(
      f"axis_name={axis_name!r} is not a mapped axis here ({e}). Call "
      "mpx.parallel.all_reduce_gradients inside jax.shard_map (or pmap, or vmap with axis_name=...) "
      "and pass the name of the mesh axis the batch is split over, e.g. 'data', or a tuple "
      "of names for a batch split over several axes."
    ) from None


def _varying_axes(x: Any) -> Any:
  """The mesh axes ``x`` varies along under ``shard_map``'s tracking; ``None`` untracked."""
  return getattr(getattr(jax.typeof(x), "mat", None), "varying", None)


def _check_not_reduced(grads: Any, axis_name: Any) -> None:
  """Raises if ``shard_map`` already summed the gradients over ``axis_name``.

  Under ``jax.shard_map`` with ``check_vma=True`` (the default), params passed
  replicated (``P()``) are invariant along the axis; their first use with a
  per-device batch inserts an implicit ``pvary``, whose transpose in the
  backward pass is a ``psum``. Their gradients then arrive summed, in the
  forward's dtype and without the division by the axis size, and a second
  reduction would multiply them by the axis size.
  """
  axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  manual = set(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))
  # JAX's flag for shard_map(check_vma=...); without the tracking, nothing can be told.
  check_vma = getattr(getattr(jax._src.config, "_check_vma", None), "value", False)  # pyright: ignore[reportAttributeAccessIssue]
  if not check_vma or not all(a in manual for a in axes):
    return
  for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
    varying = _varying_axes(leaf)
    if varying is None or all(a in varying for a in axes):
      continue
    raise errors.ConfigError(
      f"gradients leaf {tree_lib.path_str(path)!r} does not vary along {axis_name!r}: the "
      "params entered jax.shard_map replicated, so JAX already summed their gradients over "
      f"{axis_name!r} in the backward pass (in the forward's dtype, without dividing by the "
      "axis size), and reducing them again would multiply them by the axis size. Mark the "
      f"params varying before differentiating, params = jax.lax.pcast(params, {axis_name!r}, "
      "to='varying'), so that each device takes its own gradients and this function reduces "
      "them once; or run the step under jax.shard_map(..., check_vma=False)."
    )


def all_reduce_gradients(
  grads: Any, axis_name: Any, *, reduce_dtype: dtypes_lib.DTypeLike | None = None
) -> Any:
  """Averages gradients over a mapped axis, communicating them in ``reduce_dtype``.

  For data parallelism under ``jax.shard_map`` (or ``pmap``): every device
  computes the scaled gradients of its shard of the batch with
  :func:`mpx.value_and_grad`, then calls this function instead of
  ``jax.lax.pmean``. Each floating leaf ``g`` becomes

  .. math::

    \\operatorname{cast}_{\\text{leaf}}\\Big(\\sum_{d=1}^{n}
    \\operatorname{cast}_{\\text{reduce}}(g_d / n)\\Big)

  where ``n`` is the size of ``axis_name``: the division runs in float32
  (float64 stays float64) before the cast, so it rounds once; the sum is one
  all-reduce in ``reduce_dtype``, half the bytes of a float32 one for
  bfloat16 or float16; the result is cast back to the leaf's own dtype, so the
  optimizer sees the dtypes it was built for.

  Why the order is safe:

  * Dividing first bounds every partial sum by the largest ``|g_d|``, so the
    half-precision sum cannot overflow unless a local gradient already does
    not fit ``reduce_dtype`` (then the step is skipped, as it should be).
  * The loss scale is applied before the reduction, so float16 keeps the small
    gradients the scale was chosen for; dividing by ``n`` costs ``log2(n)``
    exponent steps at the bottom of the range, which dynamic loss scaling
    absorbs like any other shift.
  * Unscaling and the finite check happen afterwards, in float32, in the
    loss-scaling transformation's ``update`` (:func:`mpx.dynamic_loss_scale`,
    :func:`mpx.mixed_precision`). An inf or NaN on one device reaches every
    device through the sum, so every device skips the step and adjusts the
    scale identically, without ``axis_name`` on the transformation.

  Under ``jax.shard_map`` (with its default ``check_vma=True``), params passed
  replicated (``in_specs=P()``) must be marked varying before
  differentiating, ``jax.lax.pcast(params, axis_name, to="varying")``:
  otherwise JAX sums their gradients itself in the backward pass (the
  transpose of the implicit broadcast to the devices), in the forward's dtype
  and without the division, and this function raises rather than reduce them
  a second time. With ``check_vma=False`` gradients are always local.

  The backend decides how the all-reduce is carried out: XLA's CPU backend
  performs a bfloat16 all-reduce in float32 on bfloat16-rounded values, so
  only the float16 one halves the bytes there; GPU (NCCL) and TPU collectives
  support bfloat16 (mpx's tests measure the CPU backend only).

  Args:
    grads: a pytree of floating arrays, this device's gradients of the scaled
      loss (``None`` leaves are kept).
    axis_name: the name of the mapped axis the batch is split over, or a tuple
      of names.
    reduce_dtype: the dtype to communicate in, e.g. ``policy.compute_dtype``
      or ``"bfloat16"``; ``None`` reduces each leaf in its own dtype (a
      ``pmean`` with the division first).

  Returns:
    The mean of ``grads`` over ``axis_name``, with the structure and dtypes of
    ``grads``, the same on every device of the axis.

  Raises:
    LeafTypeError: a leaf of ``grads`` is not a floating array.
    PolicyError: ``reduce_dtype`` is not a floating dtype mpx supports.
    ConfigError: ``axis_name`` is not a mapped axis at the call site; or,
      under ``shard_map`` with ``check_vma=True``, a leaf does not vary along
      it (JAX already summed it: see below).

  Example:
    >>> import jax, jax.numpy as jnp, mpx
    >>> grads = {"w": jnp.array([[2.0, 4.0], [6.0, 8.0]])}  # two devices' gradients
    >>> mean = jax.vmap(
    ...   lambda g: mpx.parallel.all_reduce_gradients(g, "batch", reduce_dtype="bfloat16"),
    ...   axis_name="batch",
    ... )(grads)
    >>> mean["w"]  # float32 again, the same on both members
    Array([[4., 6.],
           [4., 6.]], dtype=float32)
  """
  tree_lib.check_floating_leaves(grads, what="gradients")
  dtype = None if reduce_dtype is None else dtypes_lib.parse_dtype(reduce_dtype)
  n = _axis_size(axis_name)
  _check_not_reduced(grads, axis_name)

  def local(g: jax.Array) -> jax.Array:
    wide = dtypes_lib.at_least_float32(g.dtype)
    return (g.astype(wide) / jnp.asarray(n, wide)).astype(g.dtype if dtype is None else dtype)

  shares = jax.tree.map(local, grads)
  # One psum over the whole tree: XLA sends it as a single (tuple) all-reduce.
  summed = jax.lax.psum(shares, axis_name)
  return jax.tree.map(lambda s, g: s.astype(g.dtype), summed, grads)


def state_shardings(state: Any, params: Any) -> Any:
  """Shardings for an optimizer state that place its param-shaped parts like their params.

  Masters, moments, Kahan compensation buffers, remainders and quantised
  moments are shaped like the params; sharded like them, the optimizer's
  elementwise update runs where each shard lives and nothing is gathered
  (FSDP keeps its memory savings for the float32 copies too). Everything
  else (step counts, the loss scale and its counters, schedule state) is a
  small array, replicated on the params' mesh, so every device takes the
  same skip decision.

  An eager ``tx.init(params)`` on sharded params already places its state
  by the same rule; under ``jit`` (``jax.jit(tx.init, out_shardings=...)``),
  under ``jax.eval_shape`` for a deviceless compile, or to restore a
  checkpoint onto another mesh, use this function for the shardings. Under
  ``jax.shard_map`` take their specs:
  ``jax.tree.map(lambda s: s.spec, state_shardings(state, params))``.

  The rule, for each leaf of a param-shaped part: a leaf of its param's shape
  takes the param's sharding; a smaller one (a quantised moment's per-block
  scales) keeps the param's mesh axes on its leading axes of the same size
  and is unsharded elsewhere. A Flax model's other collections (batch
  statistics, the ``"fp8_history"`` amax histories, a few scalars per layer)
  are not optimizer state: give them your own (usually replicated) shardings.

  Args:
    state: the optimizer state, as arrays or as ``jax.ShapeDtypeStruct``
      (``jax.eval_shape(tx.init, params)``).
    params: the params it was built for, as arrays or ``jax.ShapeDtypeStruct``
      whose ``sharding`` is a ``NamedSharding`` (all on one mesh).

  Returns:
    A tree of ``NamedSharding`` with the structure of ``state``, usable as
    ``out_shardings`` of ``jit``, as the shardings of ``ShapeDtypeStruct``
    targets for ``jit(...).lower`` or an orbax restore.

  Raises:
    ConfigError: a leaf of ``params`` has no ``NamedSharding`` (give them
      one: ``jax.device_put(params, shardings)``, or
      ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``).

  Example:
    >>> import jax, jax.numpy as jnp, optax, mpx
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> w = jnp.ones((4, 2), jnp.bfloat16)
    >>> params = {"w": jax.device_put(w, NamedSharding(mesh, P("data")))}
    >>> tx = mpx.mixed_precision(optax.adam(1e-3), "params=bfloat16,compute=bfloat16")
    >>> shardings = mpx.parallel.state_shardings(jax.eval_shape(tx.init, params), params)
    >>> shardings.inner_state.master_params["w"].spec
    P('data',)
    >>> shardings.loss_scale.spec  # replicated
    P()
  """
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  for path, leaf in flat:
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
      raise errors.ConfigError(
        f"params leaf {tree_lib.path_str(path)!r} has sharding {sharding!r}, not a "
        "NamedSharding: mpx.parallel.state_shardings places the state like the params, so give every "
        "param a NamedSharding first (jax.device_put(params, shardings), or "
        "jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec)))."
      )
  if not flat:
    raise errors.ConfigError("params has no array leaves: there is nothing to place the state by.")
  return tree_lib.shardings_like_params(state, params)


def _gathered_dim(spec: Any, axis_name: str, path: str) -> int | None:
  """The dimension ``spec`` splits over ``axis_name`` (``None``: not split over it)."""
  found = None
  for dim, entry in enumerate(tuple(spec)):
    names = entry if isinstance(entry, tuple) else (entry,)
    if axis_name not in names:
      continue
    if len(names) != 1:
      raise errors.ConfigError(
        f"params leaf {path!r} is split over {entry!r} along dimension {dim}: "
        "mpx.parallel.all_gather_params gathers one mesh axis, so give the leaf a spec that splits a "
        f"dimension over {axis_name!r} alone (e.g. P({axis_name!r}, 'model'))."
      )
    found = dim
  return found


def _gather_leaf(
  x: jax.Array, dim: int | None, axis_name: str, dtype: Any, reduce_dtype: Any
) -> jax.Array:
  n = _axis_size(axis_name)

  @jax.custom_vjp
  def gather(x: jax.Array) -> jax.Array:
    y = x.astype(dtype)
    if dim is None:
      varying = _varying_axes(y)
      if varying is not None and axis_name not in varying:
        # Varying, so that JAX does not sum the devices' gradients itself (the
        # transpose of its implicit broadcast) before ``bwd`` averages them.
        y = jax.lax.pcast(y, axis_name, to="varying")
      return y
    return jax.lax.all_gather(y, axis_name, axis=dim, tiled=True)

  def fwd(x: jax.Array) -> tuple[jax.Array, None]:
    return gather(x), None

  def bwd(_: None, g: jax.Array) -> tuple[jax.Array]:
    wide = dtypes_lib.at_least_float32(g.dtype)
    share = (g.astype(wide) / jnp.asarray(n, wide)).astype(reduce_dtype)
    if dim is None:
      total = jax.lax.psum(share, axis_name)
    else:
      total = jax.lax.psum_scatter(share, axis_name, scatter_dimension=dim, tiled=True)
    return (total.astype(x.dtype),)

  gather.defvjp(fwd, bwd)
  return gather(x)


def all_gather_params(
  params: Any,
  specs: Any,
  axis_name: str,
  *,
  dtype: dtypes_lib.DTypeLike,
  reduce_dtype: dtypes_lib.DTypeLike | None = None,
) -> Any:
  """Gathers fully sharded (FSDP) params inside ``jax.shard_map``, in the compute dtype.

  For FSDP with explicit collectives: each device holds a shard of every
  large param (the ``in_specs`` of ``shard_map`` split one dimension over
  ``axis_name``) and gathers the whole param just before using it. Call this
  inside the loss function, on the params being differentiated:

  * forward: each shard is cast to ``dtype`` (the policy's compute dtype),
    then all-gathered along its split dimension, so the gather moves half
    the bytes of a float32 one (paper section 3: the forward runs on half
    copies of the float32 masters);
  * backward: each device's gradient of the gathered param, divided by the
    number of devices in float32, is cast to ``reduce_dtype`` and
    reduce-scattered back to the shards, then cast to the param's own
    dtype: the mean over the devices, as :func:`mpx.parallel.all_reduce_gradients`
    takes it. Leaves not split over ``axis_name`` (small replicated norm
    scales) are cast only, and their gradients all-reduced the same way.

  ``reduce_dtype`` is the choice PyTorch FSDP2 calls ``reduce_dtype``: the
  compute dtype (the default) halves the bytes of the gradient traffic,
  ``float32`` sums the devices' contributions without rounding them to half
  precision first. Dividing before the sum keeps float16 partial sums in
  range unless a local gradient already overflows (then the step is
  skipped). Pass ``axis_name`` to the loss-scale transformation too: the
  reduced gradients are sharded, so each device checks only its shard.

  Args:
    params: the local shards of the params (a pytree of floating arrays).
    specs: the ``PartitionSpec`` of each leaf, as given to ``shard_map``'s
      ``in_specs`` (a tree with the structure of ``params``).
    axis_name: the mesh axis the params are split over, e.g. ``"data"``.
    dtype: the dtype to gather in, e.g. ``policy.compute_dtype``.
    reduce_dtype: the dtype to reduce the gradients in; ``None`` means
      ``dtype``.

  Returns:
    The whole params, in ``dtype``, on every device of ``axis_name`` (still
    split over any other mesh axis, e.g. a tensor-parallel ``"model"``).

  Raises:
    LeafTypeError: a leaf of ``params`` is not a floating array.
    TreeStructureError: ``specs`` does not have the structure of ``params``.
    PolicyError: ``dtype`` or ``reduce_dtype`` is not a floating dtype.
    ConfigError: ``axis_name`` is not a mapped axis here, or a spec splits a
      dimension over ``axis_name`` together with another axis.

  Example:
    >>> import jax, jax.numpy as jnp, mpx
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(jax.devices()[:1], ("data",))
    >>> specs = {"w": P("data", None)}
    >>> def loss(params, x):
    ...   full = mpx.parallel.all_gather_params(params, specs, "data", dtype="bfloat16")
    ...   return jnp.mean((x.astype(jnp.bfloat16) @ full["w"]).astype(jnp.float32) ** 2)
    >>> grad = jax.shard_map(
    ...   jax.grad(loss), mesh=mesh, in_specs=(specs, P("data")), out_specs=specs
    ... )
    >>> grad({"w": jnp.ones((4, 2))}, jnp.ones((8, 4)))["w"].dtype  # float32, like the param
    dtype('float32')
  """
  tree_lib.check_floating_leaves(params, what="params")
  is_spec = lambda s: isinstance(s, jax.sharding.PartitionSpec)  # noqa: E731
  spec_leaves, spec_def = jax.tree.flatten(specs, is_leaf=is_spec)
  flat, structure = jax.tree_util.tree_flatten_with_path(params)
  if spec_def != structure or not all(is_spec(s) for s in spec_leaves):
    raise errors.TreeStructureError(
      "specs must be a tree of PartitionSpec with the structure of params (the in_specs "
      f"given to shard_map for them); got {spec_def} for params {structure}."
    )
  gather_dtype = dtypes_lib.parse_dtype(dtype)
  reduce = gather_dtype if reduce_dtype is None else dtypes_lib.parse_dtype(reduce_dtype)
  _axis_size(axis_name)
  gathered = [
    _gather_leaf(
      x, _gathered_dim(spec, axis_name, tree_lib.path_str(path)), axis_name, gather_dtype, reduce
    )
    for (path, x), spec in zip(flat, spec_leaves, strict=True)
  ]
  return jax.tree.unflatten(structure, gathered)
