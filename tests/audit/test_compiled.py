"""The reader of compiled programs: collectives that XLA's combiners joined."""

import numpy as np

from mpx._src.audit import compiled as compiled_lib

# One all-gather of the FSDP x TP Llama's H100 program (tests/integration/test_fsdp_target.py),
# as XLA's all-gather combiner leaves it: a float32 activation and a float16 weight together.
_COMBINED = """HloModule step, entry_computation_layout={(f32[16,64]{1,0}, f16[128,64]{1,0})->(f32[32,64]{1,0}, f16[256,64]{1,0})}

ENTRY %main (p0: f32[16,64], p1: f16[128,64]) -> (f32[32,64], f16[256,64]) {
  %p0 = f32[16,64]{1,0} parameter(0)
  %p1 = f16[128,64]{1,0} parameter(1)
  %all-gather-start = ((f32[16,64]{1,0}, f16[128,64]{1,0}), (f32[32,64]{1,0}, f16[256,64]{1,0})) all-gather-start(%p0, %p1), channel_id=1, replica_groups={{0,1}}, dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/head/dot_general"}
  ROOT %all-gather-done = (f32[32,64]{1,0}, f16[256,64]{1,0}) all-gather-done(%all-gather-start)
}
"""


def test_a_combined_collective_is_counted_per_dtype_of_its_operands():
  found = compiled_lib.collectives(_COMBINED)
  assert [(c["kind"], c["dtype"], c["bytes"]) for c in found] == [
    ("all-gather", np.dtype(np.float32), 16 * 64 * 4),
    ("all-gather", np.dtype(np.float16), 128 * 64 * 2),
  ]
  ((instr, parts),) = compiled_lib.collectives_by_instruction(_COMBINED)
  assert instr["name"] == "all-gather-start" and parts == found
