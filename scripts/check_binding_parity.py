#!/usr/bin/env python3
"""Fails when a function of include/dpar.h (its per-topic headers included) is missing from a binding without a
written reason, or when SWIG's interface does not read one of those headers.

For each binding present in bindings/, every function dpar.h declares must be called by the binding's idiomatic
layer (Rust: `sys::dpar_x` in bindings/rust/dpar/src; Python: `_raw.dpar_x` in bindings/python/dpar; Go:
`raw.Dpar_x` or `C.dpar_x` in bindings/go/dpar; Julia: `ccall((:dpar_x` in bindings/julia/Dpar/src), or be listed in
bindings/parity_exclusions.txt as `<binding> <function>: <reason>`. The Rust raw layer (dpar-sys) must declare
every function, one to one. An option struct's `X_init` is a macro over `X_init_sized` in C: SWIG's and cgo's
calls may use either, and Rust and Julia must call `X_init_sized` with their own size of the struct. An exclusion for a function the binding does call, or for one dpar.h no longer has,
is an error too, so the list stays true.

Option structs: every field of every `dpar_*_options` struct of dpar.h (but `size` and `version`) must be set by
each binding's idiomatic layer, or be excluded as `<binding> <struct>.<field>: <reason>`. A field is set where the
binding assigns it (Rust, Python, Julia: `x.field = `, tuple assignments too; Python: a keyword of a
`_set_fields(...)` call; Go: SWIG's `x.SetField(`), or, in Julia, where an immutable mirror of the struct is built
with every field (`CommOptions(sizeof(CommOptions), ...)`). A field name that k structs share (timeout_seconds)
needs k such places. The check is textual: it proves a binding has a way to set each field, not that the value is
the user's (the bindings' tests do that).

dpar-sys: every `pub fn` of its `extern "C"` block must have its dpar.h declaration's parameter count and types
(`const T *` is `*const T`, `T **` is `*mut *mut T`, size_t is usize; a function-pointer typedef may be wrapped in
Option<>), and its return type.
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


def strip_c(text):
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def option_structs(header):
    """{struct name: [field, ...]} of dpar.h's option structs, without size and version."""
    out = {}
    for m in re.finditer(r"typedef struct (dpar_\w+_options) \{(.*?)\} \1;", strip_c(header), flags=re.S):
        fields = re.findall(r"(\w+)\s*;", m.group(2))
        out[m.group(1)] = [f for f in fields if f not in ("size", "version")]
    return out


def balanced_calls(text, name):
    """The argument text of every call `name(...)` in text."""
    out = []
    for m in re.finditer(re.escape(name) + r"\(", text):
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        out.append(text[m.end():i - 1])
    return out


def set_sites(binding, text, structs, field):
    """How many places of the binding's text set a field of this name (of any of `structs`, those that have it)."""
    if binding == "go":
        return len(re.findall(rf"\.Set{field[0].upper() + field[1:]}\(", text))
    # `x.field = v` and `x.a, x.field = a, v`
    n = len(re.findall(rf"\.{field}\b(?:\s*,\s*[\w.\[\]]+)*\s*=(?!=)", text))
    if binding == "python":
        n += sum(len(re.findall(rf"\b{field}=", call)) for call in balanced_calls(text, "_set_fields"))
    if binding == "julia":
        for struct in structs:
            camel = "".join(w.capitalize() for w in struct[len("dpar_"):].split("_"))
            n += len(re.findall(rf"\b{camel}\(sizeof\({camel}\)", text))
            n += len(re.findall(rf"\b{camel}\(\w+\[\]\.size, \w+\[\]\.version,", text))
    return n


def check_fields(structs, exclusions, checked):
    problems = []
    sharing = {}  # field name: the structs that have it
    for struct, fields in structs.items():
        for f in fields:
            sharing.setdefault(f, []).append(struct)
    for binding in checked:
        folder, pattern, _ = BINDINGS[binding]
        text = "\n".join(p.read_text() for p in sorted(folder.rglob(pattern)))
        for struct, fields in structs.items():
            for f in fields:
                reason = exclusions.get((binding, f"{struct}.{f}"))
                sites = set_sites(binding, text, sharing[f], f)
                found = sites >= len(sharing[f])
                if not found and reason is None:
                    shared = (f" (set in {sites} places; {len(sharing[f])} structs have a field of this name)"
                              if len(sharing[f]) > 1 else "")
                    problems.append(f"{binding}: {struct}.{f} is neither set nor excluded with a reason{shared}")
                if found and reason is not None:
                    problems.append(f"{binding}: {struct}.{f} is set, but excluded too (remove the exclusion)")
    return problems


C_TO_RUST = {"int32_t": "i32", "int64_t": "i64", "uint32_t": "u32", "uint64_t": "u64", "int8_t": "i8",
             "size_t": "usize", "float": "f32", "double": "f64", "char": "c_char", "void": "c_void",
             "dpar_status": "dpar_status", "int": "i32"}
C_FUNCTION_POINTERS = {"dpar_forward_hook", "dpar_destroy_fn", "dpar_custom_fn", "dpar_custom_shape_fn"}


def rust_of_c(c_type):
    """The Rust type of a C parameter or return type, pointers with their constness: `float *const *` is
    `*const *mut f32`; `void` alone is "" (no value)."""
    t = " ".join(c_type.replace("struct ", " ").split())
    m = re.fullmatch(r"(const\s+)?(\w+)\s*((?:\*\s*(?:const\b\s*)?)*)", t)
    if not m:
        return None
    base = C_TO_RUST.get(m.group(2), m.group(2))
    stars = re.findall(r"\*\s*(const)?", m.group(3))
    if not stars:
        return "" if base == "c_void" else base
    out, pointee_const = base, bool(m.group(1))
    for star_const in stars:
        out = f"*{'const' if pointee_const else 'mut'} {out}"
        pointee_const = bool(star_const)  # the const after this star qualifies the pointer the next star points at
    return out


def c_params(params):
    """[(C type, name)] of a declaration's parameter list."""
    if params.strip() in ("", "void"):
        return []
    out = []
    for p in params.split(","):
        # An array parameter (`const int64_t kernel_size[2]`) is the pointer that C makes of it.
        if (m := re.fullmatch(r"(.*?)(\w+)\s*\[[^\]]*\]\s*", p.strip())):
            out.append((m.group(1).strip() + " *", m.group(2)))
            continue
        m = re.fullmatch(r"(.*?)(\w+)\s*", p.strip())
        out.append((m.group(1).strip(), m.group(2)))
    return out


def norm_rust(t):
    t = " ".join(t.split()).replace("* ", "*")
    m = re.fullmatch(r"Option<(\w+)>", t)
    return m.group(1) if m and m.group(1) in C_FUNCTION_POINTERS else t


def check_rust_sys(header, sys_text):
    """dpar-sys's extern declarations against dpar.h's: parameter count and types, return type."""
    problems = []
    block = sys_text[sys_text.index('extern "C" {'):]
    rust = {}
    for m in re.finditer(r"pub fn (dpar_\w+)\((.*?)\)\s*(?:->\s*([^;{]+))?;", block, flags=re.S):
        params = [p.strip() for p in re.split(r",(?![^<]*>)", m.group(2)) if p.strip()]
        rust[m.group(1)] = ([norm_rust(p.split(":", 1)[1]) for p in params], norm_rust(m.group(3) or ""))
    for ret, name, params in gen_api_table.declarations(header):
        if name not in rust:
            continue  # reported above
        r_params, r_ret = rust[name]
        c = c_params(params)
        want = [norm_rust(t if rust_of_c(t) is None else rust_of_c(t)) for t, _ in c]
        if len(want) != len(r_params):
            problems.append(f"rust: dpar-sys {name} takes {len(r_params)} parameters, dpar.h {len(want)}")
            continue
        for i, ((ctype, pname), w, r) in enumerate(zip(c, want, r_params)):
            if w != r:
                problems.append(f"rust: dpar-sys {name} parameter {i + 1} ({pname}) is {r}, dpar.h's {ctype!r} "
                                f"is {w}")
        w_ret = norm_rust(ret if rust_of_c(ret) is None else rust_of_c(ret))
        if w_ret != r_ret:
            problems.append(f"rust: dpar-sys {name} returns {r_ret or '()'}, dpar.h's {ret!r} is {w_ret or '()'}")
    return problems


def check_swig_includes():
    """SWIG does not follow #include: bindings/swig/dpar.i must %include every per-topic header dpar.h includes, in
    dpar.h's order, or SWIG's Python and Go layers silently lack a topic's declarations."""
    topics = re.findall(r'^#include "(dpar/\w+\.h)"', (ROOT / "include/dpar.h").read_text(), flags=re.M)
    read = re.findall(r'^%include "(dpar/\w+\.h)"', (ROOT / "bindings/swig/dpar.i").read_text(), flags=re.M)
    if read != topics:
        return [f"swig: bindings/swig/dpar.i %includes {', '.join(read) or 'no per-topic header'}; dpar.h includes "
                f"{', '.join(topics)} (the same, in that order)"]
    return []


def main():
    header = gen_api_table.public_header_text()
    functions = [name for _, name, _ in gen_api_table.declarations(header)]
    structs = option_structs(header)
    exclusions = {}
    for n, line in enumerate((ROOT / "bindings/parity_exclusions.txt").read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"(\w+)\s+(dpar_[\w.]+):\s*(\S.*)$", line)
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
        if "." in f:
            struct, field = f.split(".", 1)
            if field not in structs.get(struct, ()):
                problems.append(f"parity_exclusions.txt: {binding} {f}: dpar.h has no such option field")
        elif f not in functions:
            problems.append(f"parity_exclusions.txt: {binding} {f}: dpar.h has no such function")
    sys_text = (ROOT / "bindings/rust/dpar-sys/src/lib.rs").read_text()
    for f in functions:
        if not re.search(rf"pub fn {f}\(", sys_text):
            problems.append(f"rust: dpar-sys does not declare {f}")
    problems += check_rust_sys(header, sys_text)
    problems += check_fields(structs, exclusions, checked)
    problems += check_swig_includes()
    for p in problems:
        print(p)
    if problems:
        return 1
    fields = sum(len(v) for v in structs.values())
    print(f"binding parity: {len(functions)} functions, {fields} fields of {len(structs)} option structs; "
          f"bindings checked: {', '.join(checked)}; dpar-sys's declarations match dpar.h; dpar.i reads every "
          f"per-topic header")
    return 0


if __name__ == "__main__":
    sys.exit(main())
