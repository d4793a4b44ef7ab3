"""The policies the float8 studies compare: the ``mixed_bfloat16`` baseline first, then every fp8 preset."""

RECIPES = (
  "mixed_bfloat16",
  "mixed_float8",
  "mixed_float8_delayed",
  "mixed_float8_rowwise",
  "mixed_mxfp8",
  "mixed_float8_blockwise",
)
