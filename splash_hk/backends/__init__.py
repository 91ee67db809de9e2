"""Kernel backends, all with the interface of `base.Backend`, one folder per hardware: `tpu/`
(JAX's splash kernel for dense calls, the library's block-list and paged kernels, the tiles and
their measured table), `xla/` (the portable block plan and gathered tiles), `native/` (the C++
CPU decode kernel), `gpu/` (ejkernel's Triton kernel); `reference` serves everything densely.
A hardware's folder imports `base`, `reference` and `xla/` (its fallback), never another's."""
