"""Finds the packages and installs the MindFormers start-up hook (a .pth file) at the top of site-packages.

Everything else is declared in pyproject.toml. Packages are discovered, never listed, so that a new
module cannot be left out of the wheel: every package under ``ft_plugins/`` ships, and nothing else
(``tests``, ``examples``, ``benchmarks``, ``scripts`` stay in the repository). The patch recipes live at
the top of the repository (``patches/``) and ship as ``ft_plugins.patches``. A .pth file must sit at
the root of site-packages, which package data cannot express.
"""

import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

STARTUP_HOOK = "ft-plugins-mindformers.pth"
PACKAGES = [*find_packages(include=["ft_plugins", "ft_plugins.*"]), "ft_plugins.patches"]


class BuildWithStartupHook(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(os.path.join("ft_plugins", "mindspore", STARTUP_HOOK),
                       os.path.join(self.build_lib, STARTUP_HOOK), preserve_mode=False)


setup(packages=PACKAGES, cmdclass={"build_py": BuildWithStartupHook})
