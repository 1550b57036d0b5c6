"""The package's metadata and wheel: keras_bn only, depending on keras and numpy."""

import email
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

import keras_bn

ROOT = pathlib.Path(__file__).resolve().parent.parent
# What a wheel is built from.
SOURCES = ["setup.cfg", "setup.py", "pyproject.toml", "README.md", "keras_bn"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Builds the wheel from a copy of the package's sources (no build isolation)."""
    pytest.importorskip("build")
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--wheel",
            "--no-isolation",
            "--outdir",
            str(out),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (path,) = out.glob("keras_bn-*.whl")
    return path


def _metadata(wheel):
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(archive.read(name))


def test_wheel_holds_keras_bn_without_tests(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    modules = {n for n in names if n.startswith("keras_bn/")}
    expected = {
        f"keras_bn/{f}"
        for f in os.listdir(ROOT / "keras_bn")
        if (f.endswith(".py") and not f.endswith("_test.py")) or f == "py.typed"
    }
    assert modules == expected
    assert all(n.startswith(("keras_bn/", "keras_bn-")) for n in names), names


def test_wheel_version_is_the_package_version(wheel):
    assert _metadata(wheel)["Version"] == keras_bn.__version__
    assert wheel.name.startswith(f"keras_bn-{keras_bn.__version__}-")


def test_dependencies_are_keras_and_numpy_and_the_rest_extras(wheel):
    requires = _metadata(wheel).get_all("Requires-Dist")
    base = sorted(re.split(r"[<>=;\s]", r)[0] for r in requires if "extra ==" not in r)
    assert base == ["keras", "numpy"], requires
    extras = {}
    for requirement in requires:
        match = re.search(r"extra == ['\"](\w+)['\"]", requirement)
        if match:
            name = re.split(r"[<>=;\s\[]", requirement)[0]
            extras.setdefault(match.group(1), set()).add(name.lower().replace("_", "-"))
    assert extras["tensorflow"] == {"tensorflow"}
    assert extras["trainers"] == {
        "tensorflow",
        "tensorflow-datasets",
        "importlib-resources",
        "tensorboard",
        "absl-py",
        "matplotlib",
        "orbax-checkpoint",
    }
    assert {"pytest", "jax", "absl-py"} <= extras["test"]
    assert extras["docs"] == {"mkdocs", "mkdocs-material", "mkdocstrings-python"}
