"""Build hook: keeps keras_bn's *_test.py modules out of the wheel.

Everything else is declared in setup.cfg.
"""

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithoutTests(build_py):
    """`build_py` that skips the test modules living beside the package's code."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [
            (pkg, module, path) for pkg, module, path in modules if not module.endswith("_test")
        ]


setup(cmdclass={"build_py": BuildPyWithoutTests})
