"""Which packages the wheel holds: found here, because pyproject.toml alone cannot say it for this layout.

The repository root is the package ``lowvram_lora`` (``package-dir`` in pyproject.toml), so its
sub-packages sit at ``engine/``, ``nodes/``, ``host/``. ``[tool.setuptools.packages.find]`` names what
it finds relative to the folder it searches (``engine``, not ``lowvram_lora.engine``) and would install
top-level ``engine`` and ``nodes`` packages (ComfyUI has its own ``nodes``). So the search runs here and
the prefix is added. Every folder under the package's own folders is listed, data-only ones too
(``engine/families/configs``, ``example_workflows/api``; setuptools warns about any it is not told of), so a new
sub-package or a new ``engine/families/<id>/`` folder is installed without editing this file. Which data
files go with them is ``[tool.setuptools.package-data]`` in pyproject.toml; tests/test_packaging.py
checks that every tracked file under these folders is shipped.

Everything else about the project is in pyproject.toml.
"""
import os

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = "lowvram_lora"
# Folders of the repository root that belong to the installed package (tests/, bench/, docs/ do not).
FOLDERS = ("engine", "nodes", "host", "web", "example_workflows")


def packages(root: str = HERE) -> list[str]:
    """``lowvram_lora`` and every folder below the package's own folders, as dotted package names."""
    found = find_namespace_packages(
        root, include=[p for folder in FOLDERS for p in (folder, f"{folder}.*")], exclude=["*__pycache__*"]
    )
    return [PACKAGE] + sorted(f"{PACKAGE}.{name}" for name in found)


class BuildPy(build_py):
    """The root folder is the package, so this file would be shipped as ``lowvram_lora/setup.py``: leave it out;
    so are test modules kept beside the code they test."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        # A family's own tests (engine/families/<id>/test_*.py) stay in the repository, not in the wheel.
        return [m for m in modules if not (package == PACKAGE and m[1] == "setup") and not m[1].startswith("test_")]


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import packages() alone
    setup(packages=packages(), cmdclass={"build_py": BuildPy})
