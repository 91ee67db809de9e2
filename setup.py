"""splash_hk: block-sparse ("splash") attention for JAX/Haiku.

Requirements are ranges: lower bounds are the versions this repository tests
(requirements-lock.txt pins the whole tested environment); there are no upper
bounds because no newer release is known to break. ejkernel is an extra: it
requires jax~=0.10.0 itself, so as a hard requirement it would pin the user's
JAX; only the Triton (GPU) backend and the bench's ejkernel baseline need it.
"""

import setuptools

setuptools.setup(
    name="splash_hk",
    version="0.1.0",
    description="Block-sparse (splash) attention for JAX and Haiku, with explicit shard_map.",
    packages=setuptools.find_packages(include=["splash_hk", "splash_hk.*"]),
    package_data={"splash_hk": ["py.typed", "backends/native/*.h", "backends/native/*.cc",
                              "backends/tpu/tiles_*.json"]},
    python_requires=">=3.11",
    install_requires=[
        "jax>=0.10.2",
        "dm-haiku>=0.0.17",  # not dm-haiku[jax]: that extra asks for jax>=0.11 (Python 3.12).
        "chex>=0.1.92",
        "absl-py>=2.5.1",
        "numpy>=2.4.6",
        "typing_extensions>=4.16.0",  # TypeVar defaults (the kernel-boundary pytrees' leaves)
    ],
    extras_require={
        "gpu": ["ejkernel>=0.0.80.3"],
        "test": ["pytest>=9.2.0", "pytest-xdist>=3.8.0", "hypothesis>=6.170.17", "mypy>=2.4.1"],
        "examples": ["optax>=0.2.8", "tqdm>=4.70.1", "matplotlib>=3.11.2"],
        "flax": ["flax>=0.12.8"],  # splash_hk.flax only; nothing else imports flax
        "quant": ["qwix>=0.1.8"],  # qwix.QArray inputs; sh.Quantized needs nothing extra
        "docs": ["sphinx>=9.0.4", "myst-parser>=5.2.0"],  # make docs
        # tokamax's TPU splash kernel: the forward of calls not differentiated, on a TPU
        "tpu": ["tokamax>=0.0.12"],
    },
)
