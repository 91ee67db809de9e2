"""The GPU backend: ejkernel's Triton block-sparse kernel (`backend`), adapted (`ejkernel`)."""
