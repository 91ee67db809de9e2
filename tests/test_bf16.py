"""bfloat16 held to FlashAttention's bar (bf16_cases.py): error against float64 (from the same
bf16 inputs) at most 2x that of `jax.nn.dot_product_attention(implementation="xla")`, for the
forward and for dq, dk, dv; on xla, splash (interpret) and under a mesh.
"""

import pytest

from bf16_cases import CASES, check_bf16

PLATFORMS = {  # name: (config fields, mesh)
    "xla": (dict(platform="xla"), None),
    "splash": (dict(platform="splash", interpret=True, allow_fallback=False), None),
    "xla_mesh": (dict(platform="xla"), "2x4"),
}


@pytest.mark.parametrize("platform", list(PLATFORMS))
@pytest.mark.parametrize("name", list(CASES))
def test_bf16_forward_and_gradients_at_most_twice_jax_nn(name, platform):
  check_bf16(name, *PLATFORMS[platform])
