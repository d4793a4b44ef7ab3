"""The GPU-target toolchain: jax's CUDA plugin and cuDNN, kept where plain jax does not load them.

Compiling for an NVIDIA GPU without one needs jax's CUDA plugin, and cuDNN
for the fused attention and convolution kernels. Installed into
``site-packages`` on a machine without an NVIDIA driver, the plugin makes every
jax program print a failed CUDA version check and driver warnings when jax
starts. So mpx keeps it in a directory of its own (by default
``<sys.prefix>/mpx-gpu-target``, inside the virtual environment), installed by
``python -m mpx.gpu_target`` from jax's own ``cuda12-local`` extra (the plugin
of the installed jax's version) and the cuDNN its ``with-cuda`` extra names,
and loads it into the process only when a GPU-target compile asks for it, with
the plugin's CUDA version check skipped (there is no driver to check). A
plugin installed into ``site-packages`` (``pip install "jax[cuda12]"`` on a
GPU machine) is used as it is.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator

from mpx._src import errors

DIR_ENV = "MPX_GPU_TARGET_DIR"
COMMAND = "python -m mpx.gpu_target"
CUDA_VERSIONS = ("12", "13")
# What the plugin prints when it starts on a machine without an NVIDIA driver: true, and known.
_NO_DRIVER_LINES = re.compile(
  r"All log messages before absl::InitializeLog\(\) is called are written to STDERR"
  r"|Could not find cuda drivers on your machine, GPU will not be used"
)


def directory() -> pathlib.Path:
  """Where ``python -m mpx.gpu_target`` installs the toolchain (``$MPX_GPU_TARGET_DIR`` if set)."""
  return pathlib.Path(os.environ.get(DIR_ENV) or pathlib.Path(sys.prefix) / "mpx-gpu-target")


def _plugin_module(cuda: str) -> str:
  return f"jax_plugins.xla_cuda{cuda}"


def _in_site_packages() -> str | None:
  for cuda in CUDA_VERSIONS:
    try:
      if importlib.util.find_spec(_plugin_module(cuda)) is not None:
        return cuda
    except ModuleNotFoundError:  # no jax plugin at all
      continue
  return None


def _in_directory() -> str | None:
  base = directory()
  return next(
    (cuda for cuda in CUDA_VERSIONS if (base / "jax_plugins" / f"xla_cuda{cuda}").is_dir()), None
  )


def available() -> bool:
  """Whether a CUDA plugin is installed, in ``site-packages`` or in :func:`directory`."""
  return _in_site_packages() is not None or _in_directory() is not None


@contextlib.contextmanager
def _driver_warnings_filtered() -> Iterator[None]:
  """Drops the plugin's known no-driver lines from file descriptor 2; passes everything else on."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile(mode="w+b") as captured:
    os.dup2(captured.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      for line in captured.read().decode(errors="replace").splitlines(keepends=True):
        if not _NO_DRIVER_LINES.search(line):
          sys.stderr.write(line)
      sys.stderr.flush()


def load() -> None:
  """Registers jax's CUDA plugin in this process for deviceless compiles, if jax has not.

  Called when a topology for a GPU target cannot be built: the plugin is not
  installed where jax discovers plugins (it is in :func:`directory`), or jax
  discovered it but its CUDA version check failed for want of a driver.

  Raises:
    ConfigError: no CUDA plugin is installed; the message gives the command.
  """
  cuda = _in_site_packages()
  if cuda is None:
    cuda = _in_directory()
    if cuda is None:
      raise errors.ConfigError(
        "Compiling for a GPU target needs jax's CUDA plugin, which is not installed. Run "
        f"`{COMMAND}` once (it installs the plugin of this jax's version and cuDNN into "
        f"{directory()}, where plain jax programs do not load them; no GPU or NVIDIA driver is "
        "needed)."
      )
    path = str(directory())
    if path not in sys.path:
      sys.path.append(path)
    importlib.invalidate_caches()
  previous = os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK")
  os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"  # read by the plugin's initialize()
  try:
    from jax._src import xla_bridge

    with _driver_warnings_filtered():
      before = set(xla_bridge._backend_factories)  # pyright: ignore[reportPrivateUsage]
      importlib.import_module(_plugin_module(cuda)).initialize()
      _run_plugin_callbacks(set(xla_bridge._backend_factories) - before)  # pyright: ignore[reportPrivateUsage]
      _hand_to_jax(cuda)
  finally:
    if previous is None:
      del os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"]
    else:
      os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = previous


def _run_plugin_callbacks(names: set[str]) -> None:
  """Runs, for plugins registered after jax's own discovery, what jax runs for the ones it found.

  jax calls the callbacks of ``xla_bridge.register_plugin_callbacks`` once, on
  the plugins it discovers when its first backend starts; a plugin registered
  later gets none. Among them is ``custom_partitioning``'s partitioner: without
  it a sharded program with a custom-partitioned op (mpx's finite check) fails
  to compile for the GPU ("No registered implementation for custom call to
  CustomSPMDPartitioning for platform CUDA").
  """
  from jax._src import xla_bridge

  with xla_bridge._plugin_callback_lock:  # pyright: ignore[reportPrivateUsage]
    for name in sorted(names):
      factory = xla_bridge._backend_factories[name]  # pyright: ignore[reportPrivateUsage]
      if factory.c_api is not None:
        for callback in xla_bridge._plugin_callbacks:  # pyright: ignore[reportPrivateUsage]
          callback(c_api=factory.c_api)


def _hand_to_jax(cuda: str) -> None:
  """Gives jax the plugin's extension modules, which jax and jaxlib look up once, on import.

  With the plugin outside ``site-packages`` they found none: jax's cuDNN
  attention then reports "cuDNN is not detected" and jaxlib's GPU modules
  (Triton kernel calls, the GPU PRNG...) registered nothing. Reloading
  jaxlib's ``gpu_*`` modules lets them register what they register when the
  plugin is there from the start; ``cuda_versions`` is set where jax reads it.
  """
  import jax._src.lib as jax_lib

  if jax_lib.cuda_versions is not None:  # jax found the plugin when it was imported
    return
  versions = importlib.import_module(f"jax_cuda{cuda}_plugin._versions")
  jax_lib.cuda_versions = versions
  for name in ("jax._src.cudnn.fused_attention_stablehlo", "jax._src.lax.linalg"):
    module = sys.modules.get(name)
    if module is not None:  # imported `cuda_versions` by name before this
      module.cuda_versions = versions  # pyright: ignore[reportAttributeAccessIssue]
  for name in sorted(n for n in sys.modules if n.startswith("jaxlib.gpu_")):
    importlib.reload(sys.modules[name])
  # mpx's attention remembers, per shape, whether cuDNN could be traced: not before now.
  from mpx._src.ops import attention

  attention.cudnn_blocker_cache_clear()


def _extra_requirements(distribution: importlib.metadata.Distribution, extra: str) -> list[str]:
  """The requirements a distribution lists under ``extra``, without their markers."""
  marker = re.compile(rf"""extra\s*==\s*["']{re.escape(extra)}["']""")
  return [
    req.split(";")[0].strip()
    for req in distribution.requires or []
    if ";" in req and marker.search(req.split(";", 1)[1])
  ]


def requirements(cuda: str = "12") -> list[str]:
  """What the toolchain installs: jax's ``cuda<N>-local`` extra, without jaxlib (already here).

  Args:
    cuda: the CUDA major version, ``"12"`` or ``"13"``.

  Returns:
    Requirement strings, e.g. ``["jax-cuda12-plugin<=0.10.2,>=0.10.2"]``.

  Raises:
    ConfigError: an unknown CUDA version, or a jax without that extra.
  """
  if cuda not in CUDA_VERSIONS:
    raise errors.ConfigError(f"cuda={cuda!r}: jax ships CUDA plugins for {CUDA_VERSIONS}.")
  extra = f"cuda{cuda}-local"
  found = _extra_requirements(importlib.metadata.distribution("jax"), extra)
  found = [r for r in found if not re.match(r"jaxlib\b", r)]
  if not found:
    raise errors.ConfigError(f"The installed jax has no {extra!r} extra to take the plugin from.")
  return found


def _pip(target: pathlib.Path, reqs: list[str], *options: str) -> None:
  command = [sys.executable, "-m", "pip", "install", "--quiet", "--upgrade", *options, "--target"]
  subprocess.run([*command, str(target), *reqs], check=True)


def install(cuda: str = "12", target: pathlib.Path | None = None) -> pathlib.Path:
  """Installs the CUDA plugin of the installed jax's version and its cuDNN into ``target``.

  The plugin comes from jax's own ``cuda<N>-local`` extra; cuDNN from the
  plugin's ``with-cuda`` extra, so the fused attention compiles too. cuDNN is
  installed without its dependencies: compiling needs cuDNN's own libraries,
  not cuBLAS (XLA builds its cuBLAS GEMM calls without the library), which
  saves about 1 GB. Nothing is installed twice: a
  ``target`` that already holds this jax's plugin is left as it is.

  Args:
    cuda: the CUDA major version, ``"12"`` or ``"13"``.
    target: the directory (default :func:`directory`).

  Returns:
    The directory.
  """
  target = target or directory()
  reqs = requirements(cuda)
  plugin = f"jax-cuda{cuda}-plugin"
  import jax

  if _installed(target, plugin) == jax.__version__ and _installed(target, f"nvidia-cudnn-cu{cuda}"):
    return target
  target.mkdir(parents=True, exist_ok=True)
  _pip(target, reqs)
  dist = _distribution(target, plugin)
  assert dist is not None, f"pip installed no {plugin} into {target}"
  cudnn = [r for r in _extra_requirements(dist, "with-cuda") if r.startswith("nvidia-cudnn")]
  _pip(target, cudnn, "--no-deps")
  return target


def _canonical(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _distribution(target: pathlib.Path, name: str) -> importlib.metadata.Distribution | None:
  return next(
    (
      d
      for d in importlib.metadata.distributions(path=[str(target)])
      if _canonical(d.metadata["Name"]) == _canonical(name)
    ),
    None,
  )


def _installed(target: pathlib.Path, name: str) -> str | None:
  dist = _distribution(target, name)
  return None if dist is None else dist.version
