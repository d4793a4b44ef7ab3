"""Numerical kernels with no Flax or optax in them: softmax, attention, normalisation, the fp8 dot."""
