"""The TPU backend: JAX's Pallas splash kernel for dense calls (`backend`, its masks `plan` and
`horizon`, its tiles `tiles`), the library's own block-list kernel (`list_kernel`, served by
`lists`) and paged kernel (`paged_kernel`, served by `paged`)."""
