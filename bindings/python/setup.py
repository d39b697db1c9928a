"""pip install bindings/python: builds dpar's Python package against an existing libdpar.so.

The raw layer (dpar.raw, over the extension dpar._raw) is SWIG's output for bindings/swig/dpar.i, generated at build time with -threads. The
library is found through DPAR_LIB_DIR (default: the CMake build tree of this checkout, build/), its headers
through DPAR_INCLUDE_DIR (default: include/), and the library's directory goes in the extension's rpath.
"""
import os
import pathlib
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
LIB_DIR = pathlib.Path(os.environ.get("DPAR_LIB_DIR", ROOT / "build")).resolve()
INCLUDE_DIR = pathlib.Path(os.environ.get("DPAR_INCLUDE_DIR", ROOT / "include")).resolve()
INTERFACE = ROOT / "bindings" / "swig" / "dpar.i"


class SwigBuildExt(build_ext):
    """Runs SWIG into the build directories (nothing generated lands in the source tree)."""

    def run(self):
        if not (LIB_DIR / "libdpar.so").exists():
            raise SystemExit(f"no libdpar.so in {LIB_DIR}: build dpar first, or set DPAR_LIB_DIR")
        tmp = pathlib.Path(self.build_temp)
        tmp.mkdir(parents=True, exist_ok=True)
        pkg = pathlib.Path(self.build_lib) / "dpar"
        pkg.mkdir(parents=True, exist_ok=True)
        wrapper = tmp / "dpar_wrap.c"
        subprocess.check_call(["swig", "-python", "-threads", f"-I{INCLUDE_DIR}", "-outdir", str(pkg),
                               "-o", str(wrapper), str(INTERFACE)])
        for ext in self.extensions:
            ext.sources = [str(wrapper)]
        super().run()


setup(
    name="dpar",
    version="0.6.0",
    description="Data-parallel training over several devices through dpar's C ABI",
    packages=["dpar"],
    python_requires=">=3.9",
    install_requires=["numpy"],
    ext_modules=[Extension("dpar._raw", sources=[], include_dirs=[str(INCLUDE_DIR)], library_dirs=[str(LIB_DIR)],
                           libraries=["dpar"], runtime_library_dirs=[str(LIB_DIR)])],
    cmdclass={"build_ext": SwigBuildExt},
)
