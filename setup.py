from pathlib import Path

from setuptools import find_packages, setup

version = {}
exec(Path("tpframe/version.py").read_text(), version)

setup(
    name="tpframe",
    version=version["__version__"],
    description="Tensor-parallel GPT training on PyTorch: readable, resumable on any layout, fast on NVLink.",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tpframe", "tpframe.*"]),
    package_data={"tpframe": ["comm/symm/thresholds.json", "layers/async_tp_auto.json"]},
    python_requires=">=3.11",
    install_requires=["torch>=2.11", "pyyaml", "numpy", "safetensors"],  # safetensors: exports, init_from
    extras_require={
        # transformers: the Hugging Face export/import tests; tensorboard: logging.tensorboard and its test
        "dev": [
            "ruff==0.17.6",
            "pytest>=7",
            "pytest-timeout",
            "pytest-xdist",  # README's test command runs the suite on two workers
            "matplotlib",
            "tokenizers",
            "transformers>=4.45",
            "tensorboard",
            "accelerate",
            "peft==0.21.2",
        ],  # accelerate: transformers' tp_plan (benchmarks/decode.py --hf-tp); peft: LoRA's --format peft test
        "wandb": ["wandb"],
    },
)
