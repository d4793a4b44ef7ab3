"""Optimizer wrappers for half-precision params: masters, compensation, state dtypes, the composite."""
