"""pyproject.toml and setup.py: what the wheel holds, the Comfy Registry metadata, and extras that never
downgrade a ComfyUI install's frontend (issue 28). Reads files only: nothing is built or installed."""
import fnmatch
import re
import runpy
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# Frontends of the ComfyUI releases the pack is checked in (tests/comfyui/README.md), and the newest one.
COMFYUI_FRONTENDS = {"ComfyUI 0.3.64": "1.27.10", "ComfyUI 0.33.0": "1.49.6", "newest (2026-10)": "1.58.1"}


# ----------------------------------------------------------------- the frontend extras


def _frontend_requirements():
    project = PYPROJECT["project"]
    found = {}
    for extra, deps in project.get("optional-dependencies", {}).items():
        for dep in deps:
            req = Requirement(dep)
            if req.name == "comfyui-frontend-package":
                found[extra] = req
    return found


def test_the_editor_and_test_extras_install_the_frontend():
    assert set(_frontend_requirements()) >= {"editor", "test"}
    # Not a runtime dependency: inside ComfyUI the frontend is ComfyUI's (and comfy-cli would read a
    # [project].dependencies entry as the pack's frontend compatibility range).
    assert not [d for d in PYPROJECT["project"]["dependencies"] if Requirement(d).name == "comfyui-frontend-package"]


@pytest.mark.parametrize("extra", ["editor", "test"])
def test_frontend_extra_has_no_pin_and_no_upper_bound(extra):
    """An exact pin or any upper bound U makes `pip install 'lowvram-lora[editor]'` inside a ComfyUI
    environment downgrade a frontend newer than U (issue 28: ==1.27.10 took 0.33's 1.49.6 back to 1.27.10)."""
    spec: SpecifierSet = _frontend_requirements()[extra].specifier
    for clause in spec:
        assert clause.operator in (">=", ">"), (
            f"[{extra}] comfyui-frontend-package{spec}: '{clause}' pins or caps the frontend; "
            "use a lower bound only (>=1.27.10)")
    for where, version in COMFYUI_FRONTENDS.items():
        assert spec.contains(Version(version)), f"[{extra}] {spec} would replace the frontend of {where} ({version})"
    assert spec.contains(Version("99.0.0"))


def test_the_frontend_range_check_catches_what_it_should():
    """The rule above, on specifiers that must fail it."""
    def ok(text):
        spec = SpecifierSet(text)
        return all(c.operator in (">=", ">") for c in spec) and all(
            spec.contains(Version(v)) for v in COMFYUI_FRONTENDS.values())

    assert ok(">=1.27.10")
    for bad in ("==1.27.10", "===1.49.6", "~=1.27.10", "<1.49", "<=1.49.6", ">=1.27,<1.59", "!=1.49.6", ">=1.50"):
        assert not ok(bad), bad


# ----------------------------------------------------------------- Comfy Registry metadata


def test_comfy_registry_section():
    """What docs.comfy.org/registry/specifications asks of pyproject.toml, and what `comfy node validate` reads."""
    project, comfy = PYPROJECT["project"], PYPROJECT["tool"]["comfy"]
    name = project["name"]  # the node id: < 100 chars, alphanumerics and single - _ ., not starting with either
    assert len(name) < 100 and re.fullmatch(r"[A-Za-z][A-Za-z0-9]*([-_.][A-Za-z0-9]+)*", name), name
    assert "comfyui" not in name.lower()
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"]), "the Registry wants X.Y.Z"
    assert project["urls"]["Repository"].startswith("https://")
    assert comfy["PublisherId"] and comfy["DisplayName"]
    assert isinstance(comfy.get("includes", []), list)
    assert re.fullmatch(r">=\d+\.\d+\.\d+", comfy["requires-comfyui"])
    for classifier in project.get("classifiers", []):
        if classifier.startswith("Operating System :: "):
            assert classifier.split(" :: ")[1] in ("Microsoft", "POSIX", "MacOS", "OS Independent")


def _comfy_cli():
    import os

    comfy = os.environ.get("LOWVRAM_COMFYUI_DIR")
    cli = Path(comfy) / "venv" / "bin" / "comfy" if comfy else None
    return cli if cli is not None and cli.is_file() else None


@pytest.mark.skipif(_comfy_cli() is None, reason="set LOWVRAM_COMFYUI_DIR to a ComfyUI whose venv has comfy-cli")
def test_comfy_node_validate_passes(tmp_path):
    """What `comfy node publish` checks first (comfy-cli's validate_node_for_publishing): pyproject.toml parses into
    a node configuration with a version, and ruff finds no exec/eval (S102, S307) or `a; b` lines (E702)."""
    import os

    env = {**os.environ, "HOME": str(tmp_path), "DO_NOT_TRACK": "1", "COMFY_NO_TELEMETRY": "1",
           "COMFY_NO_UPDATE_CHECK": "1"}
    done = subprocess.run([str(_comfy_cli()), "--skip-prompt", "node", "validate"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "All validation checks passed" in out and "Security warnings" not in out, out


def test_icon_is_in_the_repository_and_fits_the_registry():
    from PIL import Image

    url = PYPROJECT["tool"]["comfy"]["Icon"]
    assert url.startswith("https://") and url.rsplit("/", 1)[-1] == "icon.png"
    with Image.open(ROOT / "icon.png") as icon:  # SVG, PNG, JPG or GIF, at most 800 x 400
        assert icon.format == "PNG" and icon.width <= 800 and icon.height <= 400


def test_license_is_an_spdx_string():
    """setuptools >= 77 warns on a TOML table (`{ text = ... }`); comfy-cli reads a string as the license text."""
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    requires = [Requirement(r) for r in PYPROJECT["build-system"]["requires"]]
    setuptools = next(r for r in requires if r.name == "setuptools")
    assert not setuptools.specifier.contains(Version("76.9")), "SPDX strings need setuptools >= 77"


# ----------------------------------------------------------------- what the wheel holds


@pytest.fixture(scope="module")
def setup_py():
    """setup.py's names, loaded without running setup() (it runs only as __main__)."""
    pytest.importorskip("setuptools")
    return runpy.run_path(str(ROOT / "setup.py"), run_name="lowvram_lora_setup")


def _tracked_files(folder: str) -> list[str]:
    """Files under ``folder`` as git tracks them (a checkout may hold untracked scratch); walked without git."""
    try:
        out = subprocess.run(["git", "ls-files", "--", folder], cwd=ROOT, capture_output=True, text=True, check=True)
        files = out.stdout.split()
    except (OSError, subprocess.CalledProcessError):
        files = []
    if not files:
        files = [str(p.relative_to(ROOT)) for p in (ROOT / folder).rglob("*") if p.is_file()]
    return [f for f in files if "__pycache__" not in f and not f.endswith(".pyc")]


def test_packages_are_found_under_the_package_name_only(setup_py):
    packages = setup_py["packages"]()
    assert packages[0] == "lowvram_lora"
    assert all(p == "lowvram_lora" or p.startswith("lowvram_lora.") for p in packages)
    assert not [p for p in packages if "__pycache__" in p]
    for expected in ("lowvram_lora.engine", "lowvram_lora.engine.families", "lowvram_lora.nodes",
                     "lowvram_lora.host", "lowvram_lora.engine.families.configs.text", "lowvram_lora.example_workflows.api"):
        assert expected in packages


def test_every_file_of_the_package_folders_is_shipped(setup_py):
    """A new sub-package or data folder (say engine/families/<id>/) is found without editing any list;
    a data file of a new kind fails here until [tool.setuptools.package-data] names its extension."""
    packages = set(setup_py["packages"]())
    package_data = PYPROJECT["tool"]["setuptools"]["package-data"]
    missing = []
    for folder in setup_py["FOLDERS"]:
        for rel in _tracked_files(folder):
            parent, _, filename = rel.rpartition("/")
            package = "lowvram_lora." + parent.replace("/", ".")
            if package not in packages:
                missing.append(f"{rel}: its folder is not a package")
            elif not filename.endswith(".py"):
                patterns = package_data.get("*", []) + package_data.get(package, [])
                if not any(fnmatch.fnmatch(filename, p) for p in patterns):
                    missing.append(f"{rel}: no package-data pattern matches it")
    assert not missing, "not in the wheel:\n" + "\n".join(missing)


def test_the_root_package_ships_its_modules_but_not_setup_py(setup_py):
    """The root folder is `lowvram_lora`: its modules (__init__, cli, demo ...) are the package's; setup.py is not."""
    from setuptools.dist import Distribution

    assert PYPROJECT["tool"]["setuptools"]["package-dir"] == {"lowvram_lora": "."}
    assert "packages" not in PYPROJECT["tool"]["setuptools"], "setup.py finds the packages"
    dist = Distribution({"packages": ["lowvram_lora"], "package_dir": {"lowvram_lora": str(ROOT)}})
    dist.script_name = "_in_process.py"  # as under pip / python -m build (distutils skips only the script it runs)
    command = setup_py["BuildPy"](dist)
    command.initialize_options()
    command.finalize_options()
    modules = {name for _, name, _ in command.find_package_modules("lowvram_lora", str(ROOT))}
    assert {"__init__", "__main__", "cli", "demo"} <= modules
    assert "setup" not in modules
