#!/usr/bin/env bash
# CTest's test of the Python package as a user gets it, offline, in a temporary directory outside the tree:
#  1. the sdist (pyproject.toml's sdist.force-include carries dpar's sources), unpacked, builds a wheel alone
#     (scikit-build-core: dpar's CMake build, CPU only, and the extension), with no path of the tree in it;
#  2. the wheel holds the package, its types, the extension and libdpar.so.0, and no other library (libdnnl, libgomp,
#     zlib and Open MPI come from the system: Debian's packages that scripts/install-deps.sh installs);
#  3. the extension's and libdpar's run path is $ORIGIN alone;
#  4. a fresh virtual environment installs it (numpy from a local wheel), and from another directory, with
#     LD_LIBRARY_PATH and PYTHONPATH unset, loads that libdpar, runs examples/quickstart.py (train, evaluate, save,
#     reload) and the package's tests.
#   check_wheel.sh      ($DPAR_TEST_PYTHON: a Python with scikit-build-core, and a numpy wheel in the wheelhouse/ of
#                        its prefix: scripts/install-deps.sh makes build-pyenv so)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tree=$(cd "$here/../.." && pwd)
python=${DPAR_TEST_PYTHON:-python3}
# A missing dependency skips (77), except where DPAR_TEST_REQUIRE_DEPS says every one was installed (CI).
skip=77
[ -n "${DPAR_TEST_REQUIRE_DEPS:-}" ] && skip=1
for tool in cmake swig readelf; do
  command -v "$tool" >/dev/null || { echo "SKIP: no $tool (scripts/install-deps.sh installs it)"; exit $skip; }
done
if ! "$python" -c "import scikit_build_core, ensurepip, venv" 2>/dev/null; then
  echo "SKIP: $python lacks scikit-build-core, or venv (scripts/install-deps.sh makes build-pyenv with them)"
  exit $skip
fi
wheelhouse=$("$python" -c "import sys; print(sys.prefix)")/wheelhouse
if ! compgen -G "$wheelhouse/numpy-*.whl" >/dev/null; then
  echo "SKIP: no numpy wheel in $wheelhouse, from which the fresh environment installs numpy offline"
  echo "(scripts/install-deps.sh puts it there)"
  exit $skip
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/dpar-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
case "$work/" in "$tree"/*) echo "FAIL: the temporary directory $work is inside the tree"; exit 1 ;; esac
start=$SECONDS
step() { echo "--- $* ($((SECONDS - start)) s)"; }
fail() { echo "FAIL: $*"; exit 1; }

step "sdist"
mkdir "$work/sdist" "$work/src" "$work/dist" "$work/run"
(cd "$here" && "$python" -c "import sys; from scikit_build_core.build import build_sdist; build_sdist(sys.argv[1])" \
   "$work/sdist") >"$work/sdist.log" 2>&1 || { cat "$work/sdist.log"; fail "building the sdist"; }
tar -xzf "$work"/sdist/dpar-*.tar.gz -C "$work/src"
src=$(echo "$work"/src/dpar-*)
for f in pyproject.toml dpar/__init__.py dpar/__init__.pyi dpar/py.typed dpar-src/CMakeLists.txt \
         dpar-src/include/dpar.h dpar-src/include/dpar/common.h dpar-src/bindings/swig/dpar.i \
         dpar-src/bindings/python/CMakeLists.txt; do
  [ -f "$src/$f" ] || fail "the sdist lacks $f"
done

step "wheel from the unpacked sdist (dpar's C++ build included)"
if ! "$python" -m pip wheel -v --no-build-isolation --no-deps --no-index -w "$work/dist" "$src" >"$work/wheel.log" 2>&1
then
  tail -60 "$work/wheel.log"
  fail "building the wheel from the sdist"
fi
wheel=$(echo "$work"/dist/dpar-*.whl)
[ -f "$wheel" ] || fail "no wheel in $work/dist"
echo "$(basename "$wheel")"
"$python" - "$wheel" <<'EOF'
import re, sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
need = {"dpar/__init__.py", "dpar/__init__.pyi", "dpar/py.typed", "dpar/raw.py", "dpar/libdpar.so.0"}
missing = need - names
extensions = [n for n in names if re.fullmatch(r"dpar/_raw\..*\.so", n)]
libraries = sorted(n for n in names if ".so" in n and n != "dpar/libdpar.so.0" and n not in extensions)
if missing or len(extensions) != 1 or libraries:
    sys.exit(f"FAIL: the wheel lacks {sorted(missing)}, has extensions {extensions}, other libraries {libraries}")
print("the wheel holds", ", ".join(sorted(n for n in names if n.startswith("dpar/"))))
EOF

step "a fresh virtual environment installs it"
"$python" -m venv "$work/venv"
venv_python=$work/venv/bin/python
"$venv_python" -m pip install -q --no-index --find-links "$wheelhouse" "$wheel"
package=$("$venv_python" -c "import sysconfig; print(sysconfig.get_paths()['platlib'])")/dpar

step "run paths and dependencies"
for lib in "$package"/libdpar.so.0 "$package"/_raw.*.so; do
  dynamic=$(readelf -d "$lib")
  paths=$(sed -n 's/.*(\(RPATH\|RUNPATH\)).*\[\(.*\)\]$/\2/p' <<<"$dynamic" | paste -sd' ')
  needed=$(sed -n 's/.*(NEEDED).*\[\(.*\)\]$/\1/p' <<<"$dynamic" | paste -sd' ')
  echo "$(basename "$lib"): run path [$paths], needs $needed"
  [ "$paths" = '$ORIGIN' ] || fail "$(basename "$lib")'s run path is [$paths], not [\$ORIGIN]"
  for built in "$tree" "$work/src"; do
    if grep -qaF "$built" "$lib"; then fail "$(basename "$lib") holds the path $built"; fi
  done
done
needed=$(readelf -d "$package"/_raw.*.so)  # whole, first: a grep -q in a pipe could SIGPIPE readelf under pipefail
grep -q '(NEEDED).*\[libdpar\.so\.0\]' <<<"$needed" || fail "the extension does not need libdpar.so.0"

step "from another directory, nothing set: the package's own libdpar, examples/quickstart.py, the tests"
cd "$work/run"
cp "$here/examples/quickstart.py" .
clean=(env -u LD_LIBRARY_PATH -u PYTHONPATH -u DPAR_REFERENCE_LOSSES)
"${clean[@]}" "$venv_python" - "$package" <<'EOF'
import importlib.metadata, os, sys
import dpar
package = os.path.realpath(sys.argv[1])
loaded = {line.split()[-1] for line in open("/proc/self/maps") if "libdpar" in line}
if os.path.dirname(os.path.realpath(dpar.__file__)) != package or loaded != {os.path.join(package, "libdpar.so.0")}:
    sys.exit(f"FAIL: dpar from {dpar.__file__}, libdpar from {sorted(loaded)}; expected both in {package}")
if importlib.metadata.version("dpar") != dpar.version_string():
    sys.exit(f"FAIL: the wheel's version {importlib.metadata.version('dpar')} is not libdpar's {dpar.version_string()}")
print(f"dpar {dpar.version_string()} and its libdpar from {package}; {dpar.cpu_gemm_backend()}")
EOF
"${clean[@]}" "$venv_python" quickstart.py "$work/run/quickstart.safetensors"
if ! "${clean[@]}" "$venv_python" -m unittest discover -v -s "$here/tests" -t "$here/tests" >"$work/tests.log" 2>&1
then
  cat "$work/tests.log"
  fail "the package's tests, run against the wheel"
fi
grep -E "skipped '|^Ran |^OK" "$work/tests.log"
step "passed"
