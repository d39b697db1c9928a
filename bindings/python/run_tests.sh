#!/usr/bin/env bash
# CTest's driver of the Python binding in a build tree: puts the package's sources and the extension that the build
# made (bindings/python/CMakeLists.txt: dpar/_raw*.so and dpar/raw.py) together in <build dir>/python-dpar, then
# runs the package's tests there. No pip and no second build of dpar: the wheel has its own test
# (bindings/python/check_wheel.sh).
#   run_tests.sh <build dir> [<the built extension's directory>]   ($DPAR_TEST_PYTHON: a Python with numpy)
set -euo pipefail
build=$1
extension_dir=${2:-}
here=$(cd "$(dirname "$0")" && pwd)
python=${DPAR_TEST_PYTHON:-python3}
# A missing dependency skips (77), except where DPAR_TEST_REQUIRE_DEPS says every one was installed (CI).
skip=77
[ -n "${DPAR_TEST_REQUIRE_DEPS:-}" ] && skip=1
if [ -z "$extension_dir" ]; then
  echo "SKIP: this build has no Python extension (DPAR_BUILD_PYTHON: it needs swig and Python's headers;"
  echo "CMake's configure log says which was missing)"
  exit $skip
fi
if ! "$python" -c "import numpy" 2>/dev/null; then
  echo "SKIP: $python lacks numpy (scripts/install-deps.sh makes build-pyenv with it)"
  exit $skip
fi
target=$build/python-dpar
rm -rf "$target"
mkdir -p "$target/dpar"
cp "$here"/dpar/* "$target/dpar/"
cp "$extension_dir"/_raw*.so "$extension_dir"/raw.py "$target/dpar/"
cd "$build"
PYTHONPATH=$target "$python" -m unittest discover -v -s "$here/tests" -t "$here/tests"
