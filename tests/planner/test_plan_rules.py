"""A plan as keep rules and code: one path rule per family of numbered layers, code that rebuilds them."""

import re

import flax.linen as nn

import mpx
from mpx._src.planner import rules


def test_a_family_of_layers_gets_one_rule_and_the_code_rebuilds_it():
  choices = {
    f"Block_{i}/{layer}": c
    for i in range(12)
    for layer, c in [
      ("Dense_0", "mixed_float8"),
      ("Dense_1", "mixed_bfloat16"),
      ("attn/query", "mixed_bfloat16"),
    ]
  }
  choices["Block_3/Dense_1"] = "mixed_float8"  # one block differs
  flops = {path: 2.0 if "Dense" in path else 1.0 for path in choices}
  base = mpx.KeepRules().with_class(nn.Embed, "float32")
  policy, planned = rules.policy_and_rules(choices, flops, ["mixed_bfloat16", "mixed_float8"], base)
  assert policy == "mixed_bfloat16"  # 23 layers, 34 FLOPs, against 13 layers, 26 FLOPs
  patterns = [p for p, _ in planned.paths]
  assert patterns == ["^Block_\\d+/Dense_0$", "^Block_3/Dense_1$"]
  for path, choice in choices.items():  # the last matching rule names each layer's candidate
    found = [q for p, q in planned.paths if re.search(p, path)]
    assert (found[-1] if found else mpx.get_policy(policy)) == mpx.get_policy(choice), path
  scope = {"model": nn.Dense(4)}
  exec(rules.code(mpx.get_policy(policy), planned, "linen"), scope)
  assert scope["rules"] == planned and scope["model"].policy == mpx.get_policy("mixed_bfloat16")
