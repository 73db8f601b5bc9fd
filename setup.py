"""Ships ``specularch_startup.pth`` next to the package in site-packages, in regular and
editable (``pip install -e``) installs: the line it holds imports the torch-free
``specularch_boot`` module, which activates specularch at interpreter start-up, only when the
``SPECULARCH`` environment variable is set (see specularch_boot.py)."""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "specularch_startup.pth"


class build_py_with_startup_pth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self._pth_dir(), PTH), preserve_mode=False)

    def _pth_dir(self) -> str:
        if self.editable_mode:
            # editable_wheel points ``install_lib`` at the unpacked wheel; files there are
            # installed as they are (the package itself is found through setuptools' finder).
            return self.get_finalized_command("install").install_lib
        return self.build_lib

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else [*outputs, os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": build_py_with_startup_pth})
