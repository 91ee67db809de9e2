"""Kernel backends: one file each (xla, splash, triton), all with the interface of `base.Backend`."""
