"""Loss scaling: scale rules, the finite check, the transformation, the train-step helpers."""
