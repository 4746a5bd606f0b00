"""Installs the MindFormers start-up hook (a .pth file) at the top of site-packages, beside ft_plugins.

Everything else is declared in pyproject.toml; a .pth file must sit at the root of site-packages,
which package data cannot express.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

STARTUP_HOOK = "ft-plugins-mindformers.pth"


class BuildWithStartupHook(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(os.path.join("ft_plugins", "mindspore", STARTUP_HOOK),
                       os.path.join(self.build_lib, STARTUP_HOOK), preserve_mode=False)


setup(cmdclass={"build_py": BuildWithStartupHook})
