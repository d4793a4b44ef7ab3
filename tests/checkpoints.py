"""orbax round trips for the tests: save a tree, restore it into another tree's shapes."""

import pathlib
from typing import Any

import orbax.checkpoint as ocp


def round_trip(directory: pathlib.Path, tree: Any, target: Any) -> Any:
  """Saves ``tree`` with orbax's ``StandardCheckpointer`` and restores it into ``target``.

  Args:
    directory: an empty folder (pytest's ``tmp_path``).
    tree: the arrays to save.
    target: what to restore into: shapes and dtypes (``jax.eval_shape``), as a fresh run has.

  Returns:
    The restored tree.
  """
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(directory / "ckpt", tree)
    ckpt.wait_until_finished()
  with ocp.StandardCheckpointer() as ckpt:
    return ckpt.restore(directory / "ckpt", target)
