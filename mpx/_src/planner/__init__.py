"""The fp8 planner: which layers of a model to run in which float8 recipe, decided from the compiled program.

Framework-neutral modules (``cost``, ``numerics``, ``plan``) that import no
Flax; the thin ``linen`` and ``nnx`` parts build the model's gradient step
under each candidate policy and hand it over as plain callables.
"""
