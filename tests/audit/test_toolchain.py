"""The GPU-target toolchain: installed apart from plain jax, loaded only for GPU-target compiles."""

import os
import re
import subprocess
import sys
import textwrap

import jax
import pytest

from mpx._src import errors
from mpx._src.audit import targets, toolchain
from mpx.gpu_target import main


def test_requirements_are_jax_s_own_local_cuda_extra_without_jaxlib():
  (plugin,) = toolchain.requirements("12")
  assert plugin.startswith("jax-cuda12-plugin") and jax.__version__ in plugin
  (plugin13,) = toolchain.requirements("13")
  assert plugin13.startswith("jax-cuda13-plugin")
  with pytest.raises(errors.ConfigError, match="12"):
    toolchain.requirements("11")


def test_a_missing_plugin_is_one_error_naming_the_command(monkeypatch):
  def no_topology(target):
    raise NotImplementedError("topology not implemented for cuda")

  monkeypatch.setattr(targets, "_topology", no_topology)
  monkeypatch.setattr(toolchain, "_in_site_packages", lambda: None)
  monkeypatch.setenv(toolchain.DIR_ENV, "/nonexistent/mpx-gpu-target")
  with pytest.raises(errors.ConfigError, match=re.escape("python -m mpx.gpu_target")):
    targets.devices(targets.parse("h100"))
  assert main(["--check"]) == 1


def test_only_the_plugin_s_no_driver_lines_are_dropped(capfd):
  with toolchain._driver_warnings_filtered():
    os.write(
      2, b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
    )
    os.write(
      2,
      b"I0000 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.\n",
    )
    os.write(2, b"E0000 something else went wrong\n")
  assert capfd.readouterr().err == "E0000 something else went wrong\n"


def _fresh_python(code: str) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  return subprocess.run(
    [sys.executable, "-c", textwrap.dedent(code)],
    env=env,
    capture_output=True,
    text=True,
    check=True,
  )


@pytest.mark.slow  # two fresh processes, 14 s
@pytest.mark.skipif(
  toolchain._in_site_packages() is not None,
  reason="jax's CUDA plugin is installed in site-packages, where jax itself loads it and prints "
  "its failed CUDA check on a machine without a driver; `python -m mpx.gpu_target` keeps it apart",
)
def test_plain_jax_and_a_target_audit_print_nothing_without_an_environment_variable():
  proc = _fresh_python("import jax; print(jax.devices())")
  assert proc.stdout.strip() == "[CpuDevice(id=0)]" and proc.stderr == ""
  if not toolchain.available():
    return  # nothing more to check without the toolchain; CI has it (MPX_REQUIRE_GPU_TARGET)
  proc = _fresh_python(
    """
    import jax, jax.numpy as jnp, mpx
    x = jnp.ones((64, 128), jnp.bfloat16)
    report = mpx.audit(jax.grad(lambda w: jnp.sum(x @ w)), jnp.ones((128, 32), jnp.bfloat16),
                       target="h100")
    q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
    loss = lambda q: mpx.dot_product_attention(q, q, q, is_causal=True).sum()
    jax.grad(loss)(q)  # on the CPU first: cuDNN cannot be traced before the plugin is loaded
    attention = mpx.audit(jax.grad(loss), q, target="h100")
    print(report.device_kind, sorted({g.backend for g in attention.gemms}))
    """
  )
  assert proc.stdout.strip() == "NVIDIA H100 80GB HBM3 ['cudnn']" and proc.stderr == ""


def test_check_reports_what_is_installed(capsys):
  assert main(["--check"]) == (0 if toolchain.available() else 1)
  assert str(toolchain.directory()) in capsys.readouterr().out
