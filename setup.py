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


def _check_wheel_support() -> None:
    """A wheel (and its metadata) needs `bdist_wheel`: setuptools has it from 70.1, older ones from the `wheel`
    package. pip's isolated build installs what pyproject.toml asks for; `--no-build-isolation` uses the Python's
    own, and with an older setuptools and no `wheel` the build ends in "invalid command 'bdist_wheel'"."""
    import importlib.util
    import sys

    import setuptools

    wheel_commands = {"bdist_wheel", "dist_info", "editable_wheel"}
    if not wheel_commands & set(sys.argv[1:]) or importlib.util.find_spec("wheel") is not None:
        return
    try:
        from setuptools.command.bdist_wheel import bdist_wheel  # noqa: F401  (setuptools >= 70.1)
    except ImportError:
        sys.exit(f"building flagdeploy's wheel needs setuptools >= 70.1 or the `wheel` package, and this Python has "
                 f"setuptools {setuptools.__version__} without `wheel` (a build with --no-build-isolation uses them "
                 f"as they are). Run `{sys.executable} -m pip install wheel` (or upgrade setuptools), or build "
                 f"without --no-build-isolation.")


if __name__ == "__main__":  # setuptools runs this file as __main__; tests/test_wheel.py reads ROOTS from it
    _check_wheel_support()
    packages, package_dir = _packages()
    setup(packages=packages, package_dir=package_dir, package_data={"": DATA})
