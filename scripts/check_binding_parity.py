#!/usr/bin/env python3
"""Fails when a function of include/dpar.h is missing from a binding without a written reason.

For each binding present in bindings/, every function dpar.h declares must be called by the binding's idiomatic
layer (Rust: `sys::dpar_x` in bindings/rust/dpar/src; Python: `_raw.dpar_x` in bindings/python/dpar; Go:
`raw.Dpar_x` or `C.dpar_x` in bindings/go/dpar; Julia: `ccall((:dpar_x` in bindings/julia/Dpar/src), or be listed in
bindings/parity_exclusions.txt as `<binding> <function>: <reason>`. The Rust raw layer (dpar-sys) must declare
every function, one to one. An option struct's `X_init` is a macro over `X_init_sized` in C: SWIG's and cgo's
calls may use either, and Rust and Julia must call `X_init_sized` with their own size of the struct. An exclusion for a function the binding does call, or for one dpar.h no longer has,
is an error too, so the list stays true.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gen_api_table  # noqa: E402

BINDINGS = {
    "rust": (ROOT / "bindings/rust/dpar/src", "*.rs", r"\bsys::(dpar_\w+)"),
    "python": (ROOT / "bindings/python/dpar", "*.py", r"\b_raw\.(dpar_\w+)"),
    "go": (ROOT / "bindings/go/dpar", "*.go", r"\b(?:raw\.D|C\.d)(par_\w+)"),
    "julia": (ROOT / "bindings/julia/Dpar/src", "*.jl", r"ccall\(\(:(dpar_\w+)"),
}


# Bindings whose calls are C compiled against dpar.h, where dpar.h's macros apply.
C_COMPILED = {"python", "go"}


def main():
    functions = [name for _, name, _ in gen_api_table.declarations((ROOT / "include/dpar.h").read_text())]
    exclusions = {}
    for n, line in enumerate((ROOT / "bindings/parity_exclusions.txt").read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"(\w+)\s+(dpar_\w+):\s*(\S.*)$", line)
        if not m:
            sys.exit(f"parity_exclusions.txt:{n}: expected '<binding> <function>: <reason>'")
        exclusions[(m.group(1), m.group(2))] = m.group(3)
    problems = []
    checked = []
    for binding, (folder, pattern, regex) in BINDINGS.items():
        if not folder.exists():
            continue
        checked.append(binding)
        text = "\n".join(p.read_text() for p in sorted(folder.rglob(pattern)))
        called = set(re.findall(regex, text))
        if binding == "go":
            called = {"d" + c for c in called}
        for f in functions:
            plain = f[: -len("_sized")] if f.endswith("_init_sized") else f
            # An exclusion of X_init covers X_init_sized: they are one initialiser.
            reason = exclusions.get((binding, f)) or exclusions.get((binding, plain))
            if plain != f or plain + "_sized" in functions:
                # An option struct's initialiser. In C (SWIG's wrappers, cgo) X_init is the macro that passes the
                # struct's size to X_init_sized, so calling either covers both. A binding outside C must pass its
                # own size: the function named X_init writes the library's layout, which may be larger.
                if binding in C_COMPILED:
                    if (plain in called or plain + "_sized" in called) and reason is None:
                        continue
                elif f == plain and reason is None:
                    if f in called:
                        problems.append(f"{binding}: calls {f}, which writes the library's layout of the struct; "
                                        f"call {f}_sized with the binding's own size")
                    continue
            if f not in called and reason is None:
                problems.append(f"{binding}: {f} is neither called nor excluded with a reason")
            if f in called and reason is not None:
                problems.append(f"{binding}: {f} is called, but excluded too (remove the exclusion)")
    for (binding, f) in exclusions:
        if f not in functions:
            problems.append(f"parity_exclusions.txt: {binding} {f}: dpar.h has no such function")
    sys_text = (ROOT / "bindings/rust/dpar-sys/src/lib.rs").read_text()
    for f in functions:
        if not re.search(rf"pub fn {f}\(", sys_text):
            problems.append(f"rust: dpar-sys does not declare {f}")
    for p in problems:
        print(p)
    if problems:
        return 1
    print(f"binding parity: {len(functions)} functions; bindings checked: {', '.join(checked)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
