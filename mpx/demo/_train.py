"""One training run per configuration, and the activation gradients of a float32 model.

Every run differentiates the loss of a data-parallel step: the local batch's
summed token losses divided by the token count of a mirrored *global* batch
(``Settings.global_batch_tokens``, 2**19 by default), as each device does
when ``jit`` shards ``sum(loss) / global_tokens`` over a data-parallel mesh.
Per-token gradients are then ``global / local`` times smaller than those of a
per-batch mean, which is what pushes float16 activation gradients below
``2**-24``. The optimizer receives ``global / local`` times the local gradient
(``optax.scale``, first in the inner chain) in place of the all-reduce that
sums the devices' gradients, so it sees gradients of the size a real
data-parallel optimizer sees; ``global / local`` is a power of two, so in
float32 that product is exact. The reported loss is the true per-token mean.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpx
from mpx.demo._configs import RunConfig
from mpx.demo._model import CharTransformer
from mpx.demo._progress import Progress
from mpx.demo._settings import Data, Settings


@dataclasses.dataclass(frozen=True)
class RunResult:
  """What one run recorded.

  Attributes:
    config: the configuration.
    train_losses: the true per-token training loss of every step run.
    loss_scales: the loss scale each step used.
    skipped: whether each step was skipped (non-finite gradients).
    zero_grads: per step, the share of weight-gradient values that came out
      exactly zero (float16 flushing shows up here; so do rows of the token
      embedding whose character is absent from the batch, in every run).
    zero_second_moments: the share of adam's second-moment values that are exactly
      zero after the first step (``None`` if the state holds no ``nu``): where
      it is zero and adam's ``eps`` rounds to zero too, the update divides by zero.
    eval_steps: steps after which the validation loss was measured (0: at init).
    eval_losses: the validation losses.
    step_seconds: wall time of each step after the first (which compiles).
    compile_seconds: wall time of the first step.
    params: the final params.
    param_count: floating-point parameter values.
    param_bytes: bytes of the params pytree.
    opt_state_bytes: bytes of the optimizer state pytree.
    opt_state_dtypes: bytes of the optimizer state per dtype name.
    final_metrics: ``mpx.loss_scale_metrics`` of the final state, as Python values.
    warning: the ``mpx.PrecisionWarning`` raised at ``init``, if any.
    first_nonfinite_step: the first step (1-based) whose loss was not finite.
    stopped_at: the step after which the run stopped because its params were
      no longer finite (nothing can bring them back), if it did.
  """

  config: RunConfig
  train_losses: np.ndarray
  loss_scales: np.ndarray
  skipped: np.ndarray
  zero_grads: np.ndarray
  zero_second_moments: float | None
  eval_steps: list[int]
  eval_losses: list[float]
  step_seconds: np.ndarray
  compile_seconds: float
  params: Any
  param_count: int
  param_bytes: int
  opt_state_bytes: int
  opt_state_dtypes: dict[str, int]
  final_metrics: dict[str, float]
  warning: str | None
  first_nonfinite_step: int | None
  stopped_at: int | None

  @property
  def bytes_per_param(self) -> float:
    """Params plus optimizer state, in bytes per parameter value."""
    return (self.param_bytes + self.opt_state_bytes) / self.param_count


def _token_losses(
  model: Any, variables: dict[str, Any], windows: jax.Array | np.ndarray
) -> jax.Array:
  logits = model.apply(variables, windows[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:])


def _variables(params: Any, history: Any) -> dict[str, Any]:
  """The model's variables: params, and the amax histories of delayed float8 scaling if any."""
  return {"params": params, **({mpx.linen.FP8_COLLECTION: history} if history else {})}


def _tree_bytes(tree: Any) -> int:
  return sum(leaf.size * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def _bytes_by_dtype(tree: Any) -> dict[str, int]:
  found: dict[str, int] = {}
  for leaf in jax.tree.leaves(tree):
    name = np.dtype(leaf.dtype).name
    found[name] = found.get(name, 0) + _tree_bytes(leaf)
  return found


def _zero_fraction(tree: Any) -> float | None:
  leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(jax.device_get(tree))]
  total = sum(leaf.size for leaf in leaves)
  return sum(int((leaf == 0).sum()) for leaf in leaves) / total if total else None


def _floating_size(tree: Any) -> int:
  return sum(
    leaf.size for leaf in jax.tree.leaves(tree) if jnp.issubdtype(leaf.dtype, jnp.floating)
  )


def make_optimizer(config: RunConfig, settings: Settings) -> optax.GradientTransformation:
  """The run's optimizer: adamw behind the all-reduce stand-in, wrapped by ``mpx.mixed_precision``.

  Args:
    config: the configuration (policy, loss scaling, masters).
    settings: learning rate, steps and the mirrored global batch.

  Returns:
    The transformation; its state holds an ``mpx.LossScaleState``.
  """
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=settings.learning_rate,
    warmup_steps=max(1, settings.steps // 10),
    decay_steps=max(2, settings.steps),
    end_value=settings.learning_rate / 10,
  )
  inner = optax.chain(
    # Stands in for the all-reduce (sum) of the gradients of the mirrored devices.
    optax.scale(float(settings.mirrored_devices)),
    optax.adamw(schedule),
  )
  if config.compensation == "kahan":
    inner = mpx.with_kahan_summation(inner)
  elif config.compensation == "stochastic":
    inner = mpx.with_stochastic_rounding(inner, key=jax.random.key(settings.seed))
  loss_scale: Any = config.loss_scaling
  if config.scaled:
    loss_scale = functools.partial(mpx.dynamic_loss_scale, growth_interval=settings.growth_interval)
  return mpx.mixed_precision(
    inner,
    config.policy,
    loss_scale=loss_scale,
    master_dtype=jnp.float32 if config.masters else None,
  )


FP8_RULES = mpx.KeepRules().with_path("^head$", "mixed_bfloat16")
"""Float8 runs keep the logits projection in bfloat16 (the vocabulary is the widest output)."""


@functools.lru_cache(maxsize=8)
def _compiled_model(policy: str, settings: Settings) -> tuple[Any, Any, Any]:
  """The policy's model with its compiled init and evaluation, shared by runs of one policy."""
  fp8 = mpx.get_policy(policy).fp8 is not None
  model = mpx.linen.apply_policy(
    CharTransformer(settings.model), policy, rules=FP8_RULES if fp8 else None
  )

  def evaluate(params: Any, history: Any, windows: jax.Array) -> jax.Array:
    return _token_losses(model, _variables(params, history), windows).mean()

  return model, settings.jit(model.init), settings.jit(evaluate)


def param_count(settings: Settings) -> int:
  """Number of parameter values of the model, from shapes alone (nothing is computed).

  Args:
    settings: the model's shape.

  Returns:
    The count.
  """
  model = CharTransformer(settings.model)
  tokens = jax.ShapeDtypeStruct((1, settings.model.max_len), jnp.int32)
  return _floating_size(jax.eval_shape(model.init, jax.random.key(0), tokens)["params"])


def train(config: RunConfig, settings: Settings, data: Data) -> RunResult:
  """Trains the model under one configuration, with a progress bar.

  Args:
    config: the configuration.
    settings: the shared settings.
    data: the shared batches.

  Returns:
    The :class:`RunResult`.
  """
  model, init, evaluate = _compiled_model(config.policy, settings)
  # Committing every array to the device keeps the first step's compiled code valid
  # for the next steps (uncommitted inputs would compile the step a second time).
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  variables = init(jax.random.key(settings.seed), data.train[0, :, :-1])
  params = jax.device_put(variables["params"], device)
  # Delayed float8 scaling's amax histories ({} otherwise): state beside the params.
  amax_history = jax.device_put(dict(variables.get(mpx.linen.FP8_COLLECTION, {})), device)
  tx = make_optimizer(config, settings)
  with warnings.catch_warnings(record=True) as caught:
    # Expected for float16_bare (no masters); any other warning keeps the caller's filters.
    warnings.simplefilter("always", mpx.PrecisionWarning)
    opt_state = jax.device_put(settings.jit(tx.init)(params), device)
  warning = "; ".join(str(w.message) for w in caught) or None
  all_finite = settings.jit(mpx.all_finite)
  global_tokens = float(settings.global_batch_tokens)

  def objective(params: Any, history: Any, windows: jax.Array) -> tuple[jax.Array, jax.Array]:
    token_losses = _token_losses(model, _variables(params, history), windows)
    return token_losses.sum() / global_tokens, token_losses.mean()

  @settings.jit
  def step(
    params: Any, history: Any, opt_state: Any, windows: jax.Array
  ) -> tuple[Any, Any, Any, dict[str, Any]]:
    before = mpx.loss_scale_metrics(opt_state)
    (_, loss), (grads, observed) = mpx.value_and_grad(
      objective, opt_state, argnums=(0, 1), has_aux=True
    )(params, history, windows)
    # The gradient of each amax history is the amax its tensor had in this step.
    history = mpx.fp8.update_fp8_state(history, observed)
    leaves = jax.tree.leaves(grads)
    zeros = jnp.sum(jnp.stack([jnp.sum(g == 0, dtype=jnp.int32) for g in leaves]))
    # optax's adam computes python-float ** int32 step counts, which strict promotion rejects.
    with jax.numpy_dtype_promotion("standard"):
      updates, opt_state = tx.update(grads, opt_state, params)
    params = mpx.apply_updates(params, updates)
    after = mpx.loss_scale_metrics(opt_state)
    return (
      params,
      history,
      opt_state,
      {
        "loss": loss,
        "scale": before["loss_scale"],
        "skipped": after["skipped_steps"] > before["skipped_steps"],
        "zero_grads": zeros.astype(jnp.float32) / float(sum(g.size for g in leaves)),
      },
    )

  history: dict[str, list[Any]] = {"loss": [], "scale": [], "skipped": [], "zero_grads": []}
  eval_steps, eval_losses = [0], [float(evaluate(params, amax_history, data.valid))]
  seconds: list[float] = []
  first_nonfinite = stopped_at = zero_nu = None
  progress = Progress(settings.steps, config.name)
  for i in range(settings.steps):
    start = time.perf_counter()
    params, amax_history, opt_state, metrics = step(params, amax_history, opt_state, data.train[i])
    metrics = jax.device_get(metrics)
    seconds.append(time.perf_counter() - start)
    for key, value in metrics.items():
      history[key].append(value)
    loss = float(metrics["loss"])
    if first_nonfinite is None and not np.isfinite(loss):
      first_nonfinite = i + 1
    progress.update(loss, float(metrics["scale"]))
    if i == 0:
      zero_nu = _zero_fraction(optax.tree_utils.tree_get(opt_state, "nu", default=None))
    done = i + 1
    if done % settings.eval_every == 0 or done == settings.steps:
      eval_steps.append(done)
      eval_losses.append(float(evaluate(params, amax_history, data.valid)))
      if not bool(all_finite(params)) and done < settings.steps:
        stopped_at = done
        break
  note = None
  if stopped_at is not None:
    note = f"params are no longer finite after step {stopped_at}; stopping this run there."
  progress.close(note)
  final = {k: float(v) for k, v in jax.device_get(mpx.loss_scale_metrics(opt_state)).items()}
  return RunResult(
    config=config,
    train_losses=np.asarray(history["loss"], np.float64),
    loss_scales=np.asarray(history["scale"], np.float64),
    skipped=np.asarray(history["skipped"], bool),
    zero_grads=np.asarray(history["zero_grads"], np.float64),
    zero_second_moments=zero_nu,
    eval_steps=eval_steps,
    eval_losses=eval_losses,
    step_seconds=np.asarray(seconds[1:], np.float64),
    compile_seconds=seconds[0],
    params=params,
    param_count=_floating_size(params),
    param_bytes=_tree_bytes(params),
    opt_state_bytes=_tree_bytes(opt_state),
    opt_state_dtypes=_bytes_by_dtype(opt_state),
    final_metrics=final,
    warning=warning,
    first_nonfinite_step=first_nonfinite,
    stopped_at=stopped_at,
  )


def activation_gradients(settings: Settings, params: Any, windows: np.ndarray) -> np.ndarray:
  """Gradients of the training objective with respect to every block's output, in float32.

  Differentiates ``sum(token losses) / global_batch_tokens`` with respect to a
  zero perturbation added to each block's output (``Module.perturb``), so the
  values are exactly the activation gradients a float32 backward pass
  propagates there: one per token, feature and block.

  Args:
    settings: the model's shape and the global batch.
    params: trained params (any dtype; cast to float32).
    windows: one batch of windows, shape ``(batch, max_len + 1)``.

  Returns:
    A flat float32 array of the gradient values.
  """
  model = mpx.linen.apply_policy(CharTransformer(settings.model), "float32")
  shapes = jax.eval_shape(model.init, jax.random.key(0), windows[:, :-1])["perturbations"]
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  params32 = mpx.cast_tree(params, jnp.float32)
  global_tokens = float(settings.global_batch_tokens)

  def objective(perturbations: Any) -> jax.Array:
    variables = {"params": params32, "perturbations": perturbations}
    return _token_losses(model, variables, windows).sum() / global_tokens

  grads = settings.jit(jax.grad(objective))(zeros)
  return np.concatenate([np.asarray(g, np.float32).ravel() for g in jax.tree.leaves(grads)])
