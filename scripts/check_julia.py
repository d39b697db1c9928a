#!/usr/bin/env python3
"""Checks the Julia package without a Julia runtime: every .jl file of bindings/julia parses (tree-sitter-julia),
and every `ccall((:dpar_x, libdpar), Ret, (Args...), ...)` names a function that libdpar.so exports, with the
argument count and C types of its declaration in include/dpar.h (read with the per-topic headers it includes): a
pointer down to what it points at (Ptr{Csize_t} for `size_t *`, Ptr{Ptr{Cvoid}} for a handle's `**out`, the Julia
mirror of a struct). A Julia struct named after a struct of dpar.h (CommOptions for dpar_comm_options) must have its
fields, in order, with matching types, and a version constant named after one of dpar.h's
(`const COMM_OPTIONS_VERSION = UInt32(1)` for DPAR_COMM_OPTIONS_VERSION) its value. Every `Dpar.name` a file uses,
and every name the module exports, must be defined at the module's top level.

Every ccall of an engine function (dpar_engine_*, but abort, which must not wait, and the options' init) must run
in GC-safe state: inside a call of one of GC_SAFE_WRAPPERS (an argument or its do-block). An engine call may wait
for the engine's lock or its workers, and a forward hook runs Julia code on those workers; a caller blocked
outside GC-safe state would stop the hook's garbage collection for good.

A ccall into Julia's own runtime, `ccall(:jl_x, Ret, (Args...), ...)`, is checked the same way against
JULIA_RUNTIME below, the declarations of the libjulia functions that the package may call (their exports cannot be
checked here: there is no libjulia). Any other ccall is an error.

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
GC_SAFE_WRAPPERS = {"blocking", "engine_call", "path_call"}
NOT_WAITING = {"dpar_engine_abort", "dpar_engine_options_init_sized"}
# Julia's runtime functions that the package calls, as libjulia exports them (name: (return type, parameters)):
# `JL_DLLEXPORT int8_t (jl_gc_safe_enter)(void)` and `JL_DLLEXPORT void (jl_gc_safe_leave)(int8_t state)`, which
# bracket a dpar call that waits for other threads.
JULIA_RUNTIME = {"jl_gc_safe_enter": ("int8_t", "void"), "jl_gc_safe_leave": ("void", "int8_t state")}


def c_pointer(c_type):
    """(base type, pointer depth) of a C type: "float *const *" is ("float", 2)."""
    t = " ".join(c_type.replace("const", " ").replace("struct", " ").split())
    return t.replace("*", " ").strip(), t.count("*")


def julia_pointer(jl):
    """(base type, pointer depth) of a ccall type: "Ptr{Ptr{Cfloat}}" is ("Cfloat", 2); a module prefix goes."""
    depth = 0
    while (m := re.fullmatch(r"(?:Ptr|Ref)\{(.*)\}", jl.strip())):
        jl, depth = m.group(1), depth + 1
    return jl.strip().split(".")[-1], depth


def julia_struct_names(c_struct):
    """The names a Julia mirror of dpar.h's struct may have: dpar_comm_options is CommOptions (or DparCommOptions)."""
    camel = "".join(w.capitalize() for w in c_struct[len("dpar_"):].split("_"))
    return {camel, "Dpar" + camel}


def matches(c_type, jl, header):
    """Whether the ccall type `jl` passes the C type `c_type` of dpar.h (`header`: its opaque handle types and its
    structs): scalars as INTS says, `char *` as a string, a function pointer as Ptr{Cvoid}, and any other pointer as
    Ptr{}/Ref{} nested as deep as the C pointer, down to what it points at: Cvoid for a handle (or void), the
    Julia mirror of a struct, the scalar type. A `void *` takes any pointer."""
    t = " ".join(c_type.replace("const", " ").replace("struct", " ").split())
    if t in FUNCTION_POINTERS:
        return jl == "Ptr{Cvoid}"
    if t == "char *":
        return jl in {"Cstring", "Ptr{UInt8}", "Ptr{Cchar}"}
    if "*" not in t:
        return jl in INTS.get(t, {t})
    base, depth = c_pointer(c_type)
    jbase, jdepth = julia_pointer(jl)
    if (base, depth) == ("void", 1):
        return jdepth >= 1
    if jdepth != depth:
        return False
    if base == "void" or base in header.opaque:
        return jbase in INTS["void"]
    if base in header.structs:
        return jbase in julia_struct_names(base)
    if base == "char":
        return jbase in {"UInt8", "Cchar"}
    return jbase in INTS.get(base, set())


class Header:
    """What dpar.h says of its types: `opaque`, the handle types it declares without a body (and DLPack's), and
    `structs`, each struct with a body as its [(C type, field name)]."""

    def __init__(self, text):
        text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
        text = re.sub(r"//[^\n]*", "", text)
        self.opaque = set(re.findall(r"typedef\s+struct\s+(\w+)\s+\1\s*;", text))
        self.opaque |= set(re.findall(r"^\s*struct\s+(\w+)\s*;", text, flags=re.M))
        self.structs = {}
        for name, body in re.findall(r"typedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*\1\s*;", text, flags=re.S):
            fields = []
            for decl in body.split(";"):
                m = re.fullmatch(r"(.*?)(\w+)\s*(\[[^\]]*\])?", " ".join(decl.split()))
                if m:
                    # An inline array ("int64_t shape[4]") keeps its extent: no ccall type is taken as one.
                    fields.append((m.group(1).strip() + (m.group(3) or ""), m.group(2)))
            self.structs[name] = fields


def julia_structs(src):
    """Each top-level `struct` or `mutable struct` of a .jl file: {name: (line, [(field, type)])}."""
    found = {}
    for m in re.finditer(r"^(?:mutable\s+)?struct\s+(\w+)\b[^\n]*\n(.*?)^end\b", src, flags=re.S | re.M):
        fields = re.findall(r"^\s*(\w+)::(\S+)", m.group(2), flags=re.M)
        found[m.group(1)] = (src.count("\n", 0, m.start()) + 1, fields)
    return found


def check_mirrors(where_file, src, header):
    """Problems of the Julia structs that mirror a struct of dpar.h: the same fields, in order, of matching types
    (so that ccall passes them with the C layout)."""
    problems = []
    mirrors = {jname: c for c in header.structs for jname in julia_struct_names(c)}
    for name, (line, fields) in julia_structs(src).items():
        if name not in mirrors:
            continue
        c_name, c_fields = mirrors[name], header.structs[mirrors[name]]
        where = f"{where_file}:{line}"
        if [f for f, _ in fields] != [f for _, f in c_fields]:
            problems.append(f"{where}: {name} has fields {[f for f, _ in fields]}, {c_name} has "
                            f"{[f for _, f in c_fields]}")
            continue
        for (field, jl), (ctype, _) in zip(fields, c_fields):
            if not matches(ctype, jl, header):
                problems.append(f"{where}: {name}.{field} is {jl}, {c_name}.{field} is {ctype}")
    return problems


def check_versions(where_file, src, header_text):
    """Problems of the Julia constants that mirror a struct version of dpar.h (COMM_OPTIONS_VERSION for
    DPAR_COMM_OPTIONS_VERSION): a different value, or a name dpar.h does not define. A mirror that passes an older
    version with its newer layout would have its appended fields ignored."""
    problems = []
    defined = dict(re.findall(r"^#define\s+DPAR_(\w+_VERSION)\s+(\d+)\s*$", header_text, flags=re.M))
    for m in re.finditer(r"^const\s+(\w+_VERSION)\s*=\s*UInt32\((\d+)\)", src, flags=re.M):
        where = f"{where_file}:{src.count(chr(10), 0, m.start()) + 1}"
        name, value = m.group(1), m.group(2)
        if name not in defined:
            problems.append(f"{where}: {name} mirrors no version of dpar.h (no DPAR_{name})")
        elif int(value) != int(defined[name]):
            problems.append(f"{where}: {name} is {value}, dpar.h's DPAR_{name} is {defined[name]}")
    return problems


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


def c_param_type(param):
    """The C type of one parameter's declaration, its name dropped; an array parameter (`const int64_t
    kernel_size[2]`) is the pointer that C makes of it (`const int64_t *`)."""
    param = param.strip()
    if (m := re.fullmatch(r"(.*?)\w+\s*\[[^\]]*\]", param)):
        return m.group(1).strip() + " *"
    return re.sub(r"\w+$", "", param).strip() or param


def check_call(where, name, c_ret, c_params, inner, header):
    """Problems of one ccall (`inner`: its arguments, split) against a C declaration's return and parameters."""
    problems = []
    ret, argtypes = inner[1], inner[2]
    types = split_top(argtypes[1:-1]) if argtypes.startswith("(") else []
    c_types = [] if c_params.strip() == "void" else [c_param_type(p) for p in split_top(c_params)]
    if len(types) != len(c_types):
        return [f"{where}: {name} takes {len(c_types)} arguments, the ccall gives {len(types)}"]
    if not matches(c_ret, ret, header):
        problems.append(f"{where}: {name} returns {c_ret}, the ccall says {ret}")
    for i, (c, j) in enumerate(zip(c_types, types)):
        if not matches(c, j, header):
            problems.append(f"{where}: {name} argument {i + 1} is {c}, the ccall says {j}")
    given = len(inner) - 3
    if given != len(types):
        problems.append(f"{where}: {name}: {len(types)} types but {given} values")
    return problems


def modules(tree):
    """[(name, node)] of the modules a file defines at its top level."""
    return [(next(c.text.decode() for c in n.children if c.type == "identifier"), n)
            for n in tree.root_node.children if n.type == "module_definition"]


def exports(module):
    """[(line, name)] of the names a module node's export statements list."""
    return [(export.start_point[0] + 1, name)
            for export in module.children if export.type == "export_statement"
            for name in re.findall(r"[\w!]+", export.text.decode()[len("export"):])]


def module_names(tree):
    """{module: the names it defines at its top level}: functions in both forms, structs, constants, @enum types and
    values, macros. A name qualified by another module (Base.close) defines nothing here."""
    found = {}
    for name, module in modules(tree):
        names = found.setdefault(name, set())
        for node in module.children:
            text = node.text.decode()
            for pattern in (r"(?:@inline\s+)?function\s+([\w!]+)(?![\w!.])", r"(?:mutable\s+)?struct\s+(\w+)",
                            r"macro\s+(\w+)", r"([\w!]+)(?:\{[^}]*\})?\("):
                if (m := re.match(pattern, text)):
                    names.add(m.group(1))
                    break
            if node.type == "const_statement":
                names |= {n.strip() for n in re.match(r"const\s+([\w,\s]+?)\s*=", text).group(1).split(",")}
            if (m := re.match(r"@enum\s+(\w+)(?:::\w+)?\s+begin(.*)end", text, flags=re.S)):
                names |= {m.group(1)} | set(re.findall(r"^\s*(\w+)\s*=", m.group(2), flags=re.M))
    return found


def qualified_uses(tree):
    """[(line, module, name)] of every `Module.name` in a file (outside strings and comments)."""
    uses, stack = [], [tree.root_node]
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.type == "field_expression" and node.children[0].type == "identifier":
            uses.append((node.start_point[0] + 1, node.children[0].text.decode(), node.children[-1].text.decode()))
    return uses


# Julia's own functions and types that the tests and examples call unqualified. A script's call of any other name
# must be of a name the script binds or one that Dpar exports, so that a misspelt call fails here, not in a user's
# first run. Add a name here when a script starts using another of Julia's functions.
JULIA_BASE = {
    "Array", "Dict", "Float32", "Float64", "Int32", "Int64", "Ref", "UInt", "UInt32", "WeakRef", "all", "argmax",
    "ccall", "close", "copy", "count", "div", "eachindex", "enumerate", "error", "fill", "fill!", "first", "foreach",
    "get", "hcat", "hton", "isapprox", "isempty", "isfile", "isfinite", "isnan", "isodd", "isready", "joinpath",
    "length", "map", "maximum", "minimum", "mktempdir", "occursin", "open", "parse", "pointer", "println", "push!",
    "read", "reduce", "reinterpret", "reshape", "rethrow", "round", "size", "sizeof", "sleep", "sort", "split",
    "sprint", "string", "sum", "throw", "vcat", "view", "wait", "write", "zeros",
}


# Where each kind of node binds names: a function's signature (its name, parameters and type parameters), a do
# block's parameters, an arrow function's, and the target of an assignment, a for loop, a let or a catch.
BINDERS = {"function_definition": "signature", "do_clause": "argument_list", "arrow_function_expression": 0,
           "assignment": 0, "for_binding": 0, "let_binding": 0, "catch_clause": "identifier"}


def bound_names(tree):
    """Every name a script binds anywhere (see BINDERS)."""
    names, stack = set(), [tree.root_node]
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        where = BINDERS.get(node.type)
        if where is None or not node.children:
            continue
        targets = [node.children[0]] if where == 0 else [c for c in node.children if c.type == where][:1]
        while targets:
            n = targets.pop()
            if n.type == "identifier":
                names.add(n.text.decode())
            elif n.type != "field_expression":  # a.b = ... binds no name
                targets.extend(n.children)
    return names


def unqualified_calls(tree):
    """[(line, name)] of every call of a plain name in a file (macros aside)."""
    calls, stack = [], [tree.root_node]
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.type == "call_expression" and node.children[0].type == "identifier":
            calls.append((node.start_point[0] + 1, node.children[0].text.decode()))
    return calls


def check_names(parsed):
    """Problems of the names the Julia files use: every `Dpar.name` (in the tests, say) and every exported name is
    defined at the top level of the package's module; without a Julia runtime nothing else would notice a name
    that is not."""
    defined, exported = {}, {}
    for _, tree in parsed:
        for module, names in module_names(tree).items():
            defined.setdefault(module, set()).update(names)
        for module, node in modules(tree):
            exported.setdefault(module, set()).update(name for _, name in exports(node))
    problems = []
    for where_file, tree in parsed:
        for line, module, name in qualified_uses(tree):
            if module in defined and name not in defined[module]:
                problems.append(f"{where_file}:{line}: {module}.{name} is not defined by module {module}")
        if not modules(tree):  # a test or an example
            known = bound_names(tree) | JULIA_BASE | exported.get("Dpar", set())
            for line, name in unqualified_calls(tree):
                if name not in known:
                    problems.append(f"{where_file}:{line}: {name} is neither bound here, nor exported by Dpar, nor "
                                    "among the Julia functions scripts/check_julia.py knows (JULIA_BASE)")
        for mname, module in modules(tree):
            for line, name in exports(module):
                if name not in defined[mname]:
                    problems.append(f"{where_file}:{line}: {mname} exports {name}, which it does not define")
    return problems


def in_gc_safe_call(tree, offset):
    """Whether the byte at `offset` lies inside a call of one of GC_SAFE_WRAPPERS (in its arguments or do-block)."""
    node = tree.root_node.descendant_for_byte_range(offset, offset)
    while node is not None:
        if node.type == "call_expression" and node.child_count and node.children[0].type == "identifier" \
                and node.children[0].text.decode() in GC_SAFE_WRAPPERS:
            return True
        node = node.parent
    return False


def main():
    lib = sys.argv[1]
    exported = set(subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True,
                                  check=True).stdout.split())
    exported = {s.split("@")[0] for s in exported}
    header_text = gen_api_table.public_header_text()
    decls = {name: (ret, params) for ret, name, params in gen_api_table.declarations(header_text)}
    header = Header(header_text)
    parser = tree_sitter.Parser(tree_sitter.Language(tree_sitter_julia.language()))
    problems, calls, runtime_calls, files, parsed = [], 0, 0, 0, []
    for path in sorted((ROOT / "bindings/julia").rglob("*.jl")):
        files += 1
        src = path.read_text()
        tree = parser.parse(src.encode())
        parsed.append((path.relative_to(ROOT), tree))
        if tree.root_node.has_error:
            problems.append(f"{path}: does not parse")
        problems += check_mirrors(path.relative_to(ROOT), src, header)
        problems += check_versions(path.relative_to(ROOT), src, header_text)
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
                if name.startswith("dpar_engine_") and name not in NOT_WAITING and \
                        not in_gc_safe_call(tree, len(src[:m.start()].encode())):
                    problems.append(f"{where}: {name} may wait, so it must run in GC-safe state (inside one of "
                                    f"{', '.join(sorted(GC_SAFE_WRAPPERS))})")
            elif runtime and runtime.group(1) in JULIA_RUNTIME:
                name = runtime.group(1)
                runtime_calls += 1
                c_ret, c_params = JULIA_RUNTIME[name]
            elif runtime:
                problems.append(f"{where}: {runtime.group(1)} is not among the Julia runtime functions this "
                                "check knows")
                continue
            else:
                problems.append(f"{where}: ccall without (:symbol, libdpar) or :jl_symbol")
                continue
            problems += check_call(where, name, c_ret, c_params, inner, header)
    problems += check_names(parsed)
    for p in problems:
        print(p)
    if problems:
        return 1
    print(f"julia: {files} files parse, and the names they use are defined; {calls} ccalls match dpar.h and "
          f"{pathlib.Path(lib).name}'s exports; {runtime_calls} match Julia's runtime declarations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
