"""GPU targets to compile for without a GPU: the device facts and the topology of a named target.

jax's CUDA plugin (``jax-cuda12-plugin``, the same version as jax; see
:mod:`mpx._src.audit.toolchain`) builds XLA:GPU programs on a machine without an
NVIDIA driver ("deviceless AOT") from a description of the device, a
``GpuTargetConfigProto`` in text form. The
files in ``targets/`` hold the public facts of each GPU (SM count, memory,
bandwidth, compute capability), taken from XLA's own target specs
(``xla/backends/gpu/target_config/specs``) or NVIDIA's datasheets.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Any

from mpx._src import errors
from mpx._src.audit import toolchain

INSTALL_LINE = toolchain.COMMAND
_SPECS = pathlib.Path(__file__).resolve().parent / "targets"
GPUS = ("h100", "h200", "a100", "b200", "l4")
# "h100", "h100x8" (8 GPUs on one host), "2xh100x8" (2 hosts of 8).
_NAME = re.compile(r"(?:(\d+)\s*x\s*)?([a-z]\d+)(?:\s*x\s*(\d+))?")


@dataclasses.dataclass(frozen=True)
class Target:
  """A GPU target: which GPU, and how many hosts and GPUs per host.

  Attributes:
    gpu: the GPU, one of :data:`GPUS`.
    hosts: the number of hosts.
    gpus_per_host: the number of GPUs on each host.
  """

  gpu: str
  hosts: int = 1
  gpus_per_host: int = 1

  @property
  def topology(self) -> str:
    """The topology string of ``get_topology_desc``: ``"1x<hosts>x<gpus per host>"``."""
    return f"1x{self.hosts}x{self.gpus_per_host}"

  @property
  def num_devices(self) -> int:
    """The number of GPUs."""
    return self.hosts * self.gpus_per_host

  @property
  def compute_capability(self) -> tuple[int, int]:
    """The GPU's CUDA compute capability, from its target spec (``(9, 0)`` for an H100)."""
    spec = spec_text(self.gpu)
    block = re.search(r"cuda_compute_capability\s*\{([^}]*)\}", spec)
    fields = dict(re.findall(r"(major|minor):\s*(\d+)", block.group(1) if block else ""))
    return int(fields.get("major", 0)), int(fields.get("minor", 0))

  @property
  def block_scaled_mma(self) -> bool:
    """Whether the GPU's Tensor Cores multiply MX block-scaled float8 (Blackwell, compute 10+)."""
    return self.compute_capability >= (10, 0)

  def __str__(self) -> str:
    hosts = f"{self.hosts}x" if self.hosts > 1 else ""
    gpus = f"x{self.gpus_per_host}" if self.gpus_per_host > 1 else ""
    return f"{hosts}{self.gpu}{gpus}"


def parse(target: str | Target) -> Target:
  """Returns the :class:`Target` a name stands for.

  Args:
    target: ``"h100"`` (one GPU), ``"h100x8"`` (8 GPUs on one host),
      ``"2xh100x8"`` (2 hosts of 8 GPUs), likewise for every GPU of
      :data:`GPUS`; or a :class:`Target`.

  Returns:
    The target.

  Raises:
    ConfigError: the name is not of that form or names an unknown GPU.
  """
  if isinstance(target, Target):
    return target
  match = _NAME.fullmatch(str(target).strip().lower())
  if match is None or match.group(2) not in GPUS:
    raise errors.ConfigError(
      f"Unknown GPU target {target!r}. Name one of {', '.join(GPUS)}, optionally with a "
      "GPU count and a host count: 'h100x8' is 8 H100s on one host, '2xh100x8' 2 hosts of 8."
    )
  hosts, gpu, per_host = match.groups()
  target_ = Target(gpu, int(hosts or 1), int(per_host or 1))
  if target_.hosts < 1 or target_.gpus_per_host < 1:
    raise errors.ConfigError(f"The GPU target {target!r} has no GPU; counts start at 1.")
  return target_


def spec_text(gpu: str) -> str:
  """Returns the ``GpuTargetConfigProto`` text of a GPU of :data:`GPUS`.

  Args:
    gpu: a name of :data:`GPUS`.

  Returns:
    The proto in text form.
  """
  return (_SPECS / f"{gpu}.txtpb").read_text()


def plugin_available() -> bool:
  """Whether jax's CUDA plugin, which compiles for NVIDIA GPUs, is installed (anywhere mpx looks)."""
  return toolchain.available()


def _topology(target: Target) -> Any:
  from jax.experimental import topologies

  return topologies.get_topology_desc(
    platform="cuda", target_config=spec_text(target.gpu), topology=target.topology
  )


def devices(target: Target) -> list[Any]:
  """Returns the (deviceless) CUDA devices of a target, to make a mesh of.

  Loads jax's CUDA plugin first where jax has not (see
  :mod:`mpx._src.audit.toolchain`): no environment variable is needed.

  Args:
    target: the target.

  Returns:
    ``target.num_devices`` devices, host-major.

  Raises:
    ConfigError: the CUDA plugin is missing (the message says how to install
      it), or it is installed and jax still cannot build a CUDA topology.
  """
  try:
    return list(_topology(target).devices)
  except NotImplementedError:
    toolchain.load()
  try:
    return list(_topology(target).devices)
  except NotImplementedError as e:
    raise errors.ConfigError(
      f"jax's CUDA plugin is installed and loaded, yet jax cannot build a CUDA topology for the "
      f"GPU target {target} ({e}). Is the plugin of the same version as jax? Reinstall it with "
      f"`{toolchain.COMMAND}`."
    ) from e
