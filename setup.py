"""The package list comes from the tree, so that a new subpackage cannot be left out of the wheel.

The import namespace is one (`flagdeploy.*`), the source folders are several (DESIGN.md's fixed top level):
each folder in ROOTS is discovered as namespace packages and mapped under its import name. A folder of data
only (profiles/presets, quantize/policies, backends/cpu/csrc) is a package too, so DATA below reaches it.
Everything else about the project is declared in pyproject.toml; tests/test_wheel.py holds the wheel to the tree.
"""

from setuptools import find_namespace_packages, setup

# import name -> source folder
ROOTS = {
    "flagdeploy": "flagdeploy",
    "flagdeploy.backends": "backends",
    "flagdeploy.quantize": "quantize",
    "flagdeploy.installer": "installer",
    "flagdeploy.profiles": "profiles",
}
# Data files shipped beside the code, in every package (declared once: the kinds of file, not their places).
DATA = ["*.yaml", "*.json", "*.cpp", "*.h"]


def _packages() -> tuple[list[str], dict[str, str]]:
    packages, package_dir = [], {}
    for name, folder in ROOTS.items():
        package_dir[name] = folder
        packages.append(name)
        packages += [f"{name}.{sub}" for sub in find_namespace_packages(where=folder, exclude=["*__pycache__"])]
    return sorted(packages), package_dir


if __name__ == "__main__":  # setuptools runs this file as __main__; tests/test_wheel.py reads ROOTS from it
    packages, package_dir = _packages()
    setup(packages=packages, package_dir=package_dir, package_data={"": DATA})
