"""Install amp and fp16_utils (pure Python); the amp_C extension build is added by issue 5."""
from setuptools import find_packages, setup

setup(
    name="amp",
    version="0.1.0",
    packages=find_packages(include=["amp", "amp.*", "fp16_utils", "fp16_utils.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.1,<3", "packaging"],
    extras_require={
        "test": ["pytest>=7", "hypothesis>=6"],
        "examples": ["scikit-learn", "tqdm", "matplotlib"],
    },
)
