#!/usr/bin/env bash
# CTest's driver of the Python binding: pip-installs bindings/python (SWIG builds the raw layer) into a target
# directory of the build tree, then runs its tests there.
#   run_tests.sh <build dir> <libdpar dir>     ($DPAR_TEST_PYTHON: a Python with numpy, setuptools and wheel)
set -euo pipefail
build=$1
libdir=$2
here=$(cd "$(dirname "$0")" && pwd)
python=${DPAR_TEST_PYTHON:-python3}
# A missing dependency skips (77), except where DPAR_TEST_REQUIRE_DEPS says every one was installed (CI).
skip=77
[ -n "${DPAR_TEST_REQUIRE_DEPS:-}" ] && skip=1
if ! "$python" -c "import numpy, setuptools, wheel" 2>/dev/null; then
  echo "SKIP: $python lacks numpy, setuptools or wheel (scripts/install-deps.sh makes build-pyenv with them)"
  exit $skip
fi
command -v swig >/dev/null || { echo "SKIP: no swig (scripts/install-deps.sh installs it)"; exit $skip; }
target=$build/python-dpar
rm -rf "$target"
DPAR_LIB_DIR=$libdir "$python" -m pip install -q --no-build-isolation --no-deps --target "$target" "$here"
cd "$build"
PYTHONPATH=$target "$python" -m unittest discover -v -s "$here/tests" -t "$here/tests"
