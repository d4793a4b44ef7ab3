"""``python -m mpx.gpu_target``: installs what compiling for an NVIDIA GPU without one needs.

``mpx.audit(step, *args, target="h100")`` and ``benchmarks/run.py --target``
compile for a GPU on a machine that has none, through jax's CUDA plugin (and
cuDNN, for fused attention and convolutions). This command installs the plugin
of the installed jax's version (jax's own ``cuda12-local`` extra) and the
cuDNN the plugin names into a directory of the virtual environment
(``<sys.prefix>/mpx-gpu-target``, or ``$MPX_GPU_TARGET_DIR``), where plain jax
programs do not load them: on a machine without an NVIDIA driver they would
print a failed CUDA check whenever jax starts. mpx loads them when a
GPU-target compile needs them. Running it again installs nothing new;
``--check`` only reports. ``--cuda 13`` takes the CUDA 13 plugin.
"""

import argparse
import sys

from mpx._src.audit import toolchain


def main(argv: list[str] | None = None) -> int:
  """Installs (or, with ``--check``, reports) the GPU-target toolchain.

  Args:
    argv: the command's arguments (``sys.argv[1:]`` when ``None``).

  Returns:
    The exit status: 0, or 1 when ``--check`` finds no toolchain.
  """
  parser = argparse.ArgumentParser(
    prog="python -m mpx.gpu_target", description=(__doc__ or "").splitlines()[0]
  )
  parser.add_argument("--cuda", choices=toolchain.CUDA_VERSIONS, default="12")
  parser.add_argument("--check", action="store_true", help="report, install nothing")
  args = parser.parse_args(argv)
  if args.check:
    found = toolchain.available()
    print(f"GPU-target toolchain: {'installed' if found else 'missing'} ({toolchain.directory()})")
    return 0 if found else 1
  where = toolchain.install(args.cuda)
  print(f"GPU-target toolchain (jax's CUDA {args.cuda} plugin, cuDNN) in {where}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
