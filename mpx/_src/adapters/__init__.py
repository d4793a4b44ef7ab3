"""The Flax adapters: keep rules, layer policies, lean norms, linen and NNX."""
