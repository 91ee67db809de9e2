"""splash_hk: block-sparse ("splash") attention for JAX/Haiku."""

import setuptools

setuptools.setup(
    name="splash_hk",
    version="0.1.0",
    description="Block-sparse (splash) attention for JAX and Haiku, with explicit shard_map.",
    packages=setuptools.find_packages(include=["splash_hk", "splash_hk.*"]),
    python_requires=">=3.11",
    install_requires=[
        "jax==0.10.2",
        "jaxlib==0.10.2",
        "ejkernel==0.0.80.3",
        "dm-haiku==0.0.17",  # not dm-haiku[jax]: that extra asks for jax>=0.11.
        "chex==0.1.92",
        "absl-py==2.5.1",
        "numpy==2.4.6",
    ],
    extras_require={
        "test": ["pytest==9.2.0", "hypothesis==6.170.17"],
        "examples": ["optax==0.2.8", "tqdm==4.70.1", "matplotlib==3.11.2"],
    },
)
