#!/usr/bin/env python3
"""Checks the Julia package without a Julia runtime: every .jl file of bindings/julia parses (tree-sitter-julia),
and every `ccall((:dpar_x, libdpar), Ret, (Args...), ...)` names a function that libdpar.so exports, with the
argument count and C types of its declaration in include/dpar.h.

A ccall into Julia's own runtime, `ccall(:jl_x, Ret, (Args...), ...)`, is checked the same way against
JULIA_RUNTIME below, the declarations of julia.h that the package may call (its exports cannot be checked here:
there is no libjulia). Any other ccall is an error.

  check_julia.py <libdpar.so>      (needs the Python packages tree-sitter and tree-sitter-julia)
Exits 77 (CTest's skip) when they are missing; where `julia` is on the PATH, CTest runs Pkg.test() too.
"""
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gen_api_table  # noqa: E402

try:
    import tree_sitter
    import tree_sitter_julia
except ImportError:
    print("SKIP: the Python packages tree-sitter and tree-sitter-julia are not installed")
    # Where DPAR_TEST_REQUIRE_DEPS says every dependency was installed (CI), a missing one fails.
    sys.exit(1 if os.environ.get("DPAR_TEST_REQUIRE_DEPS") else 77)

INTS = {"int32_t": {"Int32", "Cint"}, "dpar_status": {"Int32", "Cint"}, "int64_t": {"Int64", "Clonglong"},
        "uint64_t": {"UInt64", "Culonglong"}, "uint32_t": {"UInt32", "Cuint"}, "size_t": {"Csize_t", "UInt"},
        "float": {"Cfloat", "Float32"}, "double": {"Cdouble", "Float64"}, "void": {"Cvoid", "Nothing"},
        "int8_t": {"Int8"}, "dpar_device": {"DparDevice"}}
FUNCTION_POINTERS = {"dpar_forward_hook", "dpar_destroy_fn"}
# Julia's runtime functions that the package calls, as julia.h declares them (name: (return type, parameters)).
# jl_gc_safe_enter/leave bracket a dpar call that waits for other threads (src/jlapi.c: `JL_DLLEXPORT int8_t
# (jl_gc_safe_enter)(void)`, `JL_DLLEXPORT void (jl_gc_safe_leave)(int8_t state)`).
JULIA_RUNTIME = {"jl_gc_safe_enter": ("int8_t", "void"), "jl_gc_safe_leave": ("void", "int8_t state")}


def julia_types(c_type):
    """The Julia types a C parameter or return type may be given as."""
    t = " ".join(c_type.replace("const", " ").replace("struct", " ").split())
    if t in FUNCTION_POINTERS:
        return {"Ptr{Cvoid}"}
    if t == "char *":
        return {"Cstring", "Ptr{UInt8}", "Ptr{Cchar}"}
    if t.endswith("*"):
        return {"POINTER"}
    return INTS.get(t, {t})


def matches(c_type, jl):
    allowed = julia_types(c_type)
    if "POINTER" in allowed:
        return jl.startswith("Ptr{") or jl.startswith("Ref{") or jl == "Cstring"
    return jl in allowed


def split_top(text):
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def balanced(text, start):
    """The text inside the parentheses opening at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] == "("
        depth -= text[i] == ")"
        if depth == 0:
            return text[start + 1:i]
    raise ValueError("unbalanced")


def check_call(where, name, c_ret, c_params, inner):
    """Problems of one ccall (`inner`: its arguments, split) against a C declaration's return and parameters."""
    problems = []
    ret, argtypes = inner[1], inner[2]
    types = split_top(argtypes[1:-1]) if argtypes.startswith("(") else []
    c_types = [] if c_params.strip() == "void" else [re.sub(r"\w+$", "", p).strip() or p
                                                    for p in split_top(c_params)]
    if len(types) != len(c_types):
        return [f"{where}: {name} takes {len(c_types)} arguments, the ccall gives {len(types)}"]
    if not matches(c_ret, ret):
        problems.append(f"{where}: {name} returns {c_ret}, the ccall says {ret}")
    for i, (c, j) in enumerate(zip(c_types, types)):
        if not matches(c, j):
            problems.append(f"{where}: {name} argument {i + 1} is {c}, the ccall says {j}")
    given = len(inner) - 3
    if given != len(types):
        problems.append(f"{where}: {name}: {len(types)} types but {given} values")
    return problems


def main():
    lib = sys.argv[1]
    exported = set(subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True,
                                  check=True).stdout.split())
    exported = {s.split("@")[0] for s in exported}
    decls = {name: (ret, params) for ret, name, params in gen_api_table.declarations(
        (ROOT / "include/dpar.h").read_text())}
    parser = tree_sitter.Parser(tree_sitter.Language(tree_sitter_julia.language()))
    problems, calls, runtime_calls, files = [], 0, 0, 0
    for path in sorted((ROOT / "bindings/julia").rglob("*.jl")):
        files += 1
        src = path.read_text()
        tree = parser.parse(src.encode())
        if tree.root_node.has_error:
            problems.append(f"{path}: does not parse")
        for m in re.finditer(r"ccall\(", src):
            inner = split_top(balanced(src, m.end() - 1))
            line = src.count("\n", 0, m.start()) + 1
            where = f"{path.relative_to(ROOT)}:{line}"
            target = re.match(r"\(:(\w+),\s*libdpar\)", inner[0])
            runtime = re.fullmatch(r":(jl_\w+)", inner[0])
            if target:
                name = target.group(1)
                calls += 1
                if name not in exported:
                    problems.append(f"{where}: {name} is not exported by {lib}")
                if name not in decls:
                    problems.append(f"{where}: {name} is not declared in dpar.h")
                    continue
                c_ret, c_params = decls[name]
            elif runtime and runtime.group(1) in JULIA_RUNTIME:
                name = runtime.group(1)
                runtime_calls += 1
                c_ret, c_params = JULIA_RUNTIME[name]
            elif runtime:
                problems.append(f"{where}: {runtime.group(1)} is not among the Julia runtime functions this check knows")
                continue
            else:
                problems.append(f"{where}: ccall without (:symbol, libdpar) or :jl_symbol")
                continue
            problems += check_call(where, name, c_ret, c_params, inner)
    for p in problems:
        print(p)
    if problems:
        return 1
    print(f"julia: {files} files parse; {calls} ccalls match dpar.h and {pathlib.Path(lib).name}'s exports; "
          f"{runtime_calls} match Julia's runtime declarations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
