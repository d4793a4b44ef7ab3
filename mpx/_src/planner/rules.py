"""A plan as keep rules and as code: the model-level policy, path rules per family of layers."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from mpx._src import policy as policy_lib
from mpx._src.adapters import keep as keep_lib


def name(policy: policy_lib.Policy) -> str:
  """A policy's preset name if it has one, else its string form (both parse back)."""
  return next(
    (k for k, v in policy_lib.PRESETS.items() if policy_lib.get_policy(v) == policy), str(policy)
  )


def policy_and_rules(
  choices: dict[str, str], flops: dict[str, float], names: Sequence[str], rules: keep_lib.KeepRules
) -> tuple[str, keep_lib.KeepRules]:
  """The model-level candidate and the keep rules that give the other layers theirs.

  Args:
    choices: ``{layer path: candidate}``.
    flops: ``{layer path: its FLOPs}``.
    names: the candidates, the baseline first.
    rules: the rules every candidate ran under.

  Returns:
    The candidate of most of the decided FLOPs (the baseline on a tie), and
    ``rules`` with a path rule per family of layers in another candidate.
  """
  by_flops: dict[str, float] = {}
  for path, choice in choices.items():
    by_flops[choice] = by_flops.get(choice, 0.0) + flops[path]
  policy = max(names, key=lambda n: (by_flops.get(n, 0.0), n == names[0]))
  for candidate in names:
    mine = [p for p, c in choices.items() if c == candidate != policy]
    for pattern in _rule_pattern(mine, list(choices)):
      rules = rules.with_path(pattern, candidate)
  return policy, rules


def _rule_pattern(paths: list[str], layers: list[str]) -> list[str]:
  """Patterns naming exactly ``paths`` among ``layers``: one per family of numbered layers where possible.

  A family generalises some of a path's numbers (``Block_\\d+/Dense_0``); the one naming
  the most paths not named yet, all of its members in ``paths``, names them at once.
  """
  out, done = [], set()
  for path in paths:
    if path in done:
      continue
    pieces = re.split(r"(\d+)", path)  # text, number, text, number, ..., text
    numbers = range(1, len(pieces), 2)
    best = (f"^{re.escape(path)}$", [path])
    for mask in range(1, 2 ** len(numbers)):
      family = "".join(
        r"\d+" if i in numbers and mask >> numbers.index(i) & 1 else re.escape(piece)
        for i, piece in enumerate(pieces)
      )
      members = [p for p in layers if re.fullmatch(family, p)]
      fresh = [p for p in members if p not in done]
      if len(fresh) > len(best[1]) and all(p in paths for p in members):
        best = (f"^{family}$", fresh)
    out.append(best[0])
    done.update(best[1])
  return out


def code(policy: policy_lib.Policy, rules: keep_lib.KeepRules, framework: str) -> str:
  """The Python that builds ``rules`` and applies ``policy`` with them to ``model``."""
  imports = {"import mpx"}
  flags = [
    f"{f.name}={getattr(rules, f.name)!r}"
    for f in dataclasses.fields(rules)
    if f.name not in ("classes", "paths", "instances") and getattr(rules, f.name) != f.default
  ]
  chain = [f"rules = mpx.KeepRules({', '.join(flags)})"]
  for cls, p in rules.classes:
    imports.add(f"import {cls.__module__}")
    chain.append(f"  .with_class({cls.__module__}.{cls.__qualname__}, {name(p)!r})")
  for pattern, p in rules.paths:
    chain.append(f"  .with_path({pattern!r}, {name(p)!r})")
  lines = [*sorted(imports), ""]
  lines += [chain[0]] if len(chain) == 1 else ["rules = (", "  " + chain[0][8:], *chain[1:], ")"]
  if rules.instances:
    lines.append(
      f"# {len(rules.instances)} instance rules of the original rules are not written here"
    )
  lines.append(f"model = mpx.{framework}.apply_policy(model, {name(policy)!r}, rules=rules)")
  return "\n".join(lines)
