from setuptools import find_packages, setup

setup(
    name="hf_bpd",
    version="0.1.0",
    description="Blockwise parallel decoding with draft refinement for Hugging Face Transformers",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["hf_bpd", "hf_bpd.*"]) + ["hf_bpd.model_cards"],
    package_dir={"hf_bpd": "hf_bpd", "hf_bpd.model_cards": "model_cards"},
    # csrc: the n-gram rescorer's compiled fast path
    package_data={"hf_bpd.model_cards": ["*.md"], "hf_bpd.rescorers": ["csrc/*.cpp"]},
    install_requires=[
        "torch==2.13.0",
        "transformers>=5.23,<6",
        "accelerate>=1.10",
        "peft>=0.17",
        "safetensors>=0.6",
        "huggingface-hub>=1.0",
        "datasets>=4.0",
        "gguf>=0.17",
        "tqdm",
        "matplotlib",
        "kenlm",
    ],
    extras_require={"test": ["pytest>=8", "hypothesis>=6", "scipy"]},
    entry_points={"console_scripts": ["hf-bpd=hf_bpd.cli:main"]},
)
