from setuptools import find_packages, setup

setup(
    name="megatron-mesh-cp",
    version="0.1.0",
    description="Mesh-Attention context parallelism (arXiv 2512.20968) for Megatron-LM",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_mesh_cp", "megatron_mesh_cp.*"]),
    package_data={"megatron_mesh_cp": ["configs/**/*.yaml"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy", "pyyaml"],
    extras_require={
        "megatron": ["megatron-core>=0.16", "pyyaml"],
        "test": ["pytest>=8", "pyyaml"],
        "plot": ["matplotlib"],
    },
)
