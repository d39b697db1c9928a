"""dpar/__init__.pyi, the package's types, against the package itself: the same public names, each function and
method with the same parameters (names, kinds, which have defaults), properties and class methods where the package
has them, and every enum member with its value. A name added to the package and not to the stub fails here."""
import ast
import enum
import inspect
import os
import types
import unittest

import dpar


def stub_tree():
    path = os.path.join(os.path.dirname(dpar.__file__), "__init__.pyi")
    with open(path) as f:
        return ast.parse(f.read(), path)


def public(names):
    return {n for n in names if not n.startswith("_") or (n.startswith("__") and n.endswith("__"))}


def stub_parameters(fn):
    """[(name, kind, has default)] of a stub's function, as inspect.Parameter would give them."""
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [False] * (len(positional) - len(a.defaults)) + [True] * len(a.defaults)
    out = [(p.arg, inspect.Parameter.POSITIONAL_ONLY, d) for p, d in zip(a.posonlyargs, defaults)]
    out += [(p.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, d) for p, d in zip(a.args, defaults[len(a.posonlyargs):])]
    if a.vararg:
        out.append((a.vararg.arg, inspect.Parameter.VAR_POSITIONAL, False))
    out += [(p.arg, inspect.Parameter.KEYWORD_ONLY, d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append((a.kwarg.arg, inspect.Parameter.VAR_KEYWORD, False))
    return out


def runtime_parameters(fn):
    parameters = inspect.signature(fn).parameters.values()
    return [(p.name, p.kind, p.default is not inspect.Parameter.empty) for p in parameters]


def decorators(fn):
    return {d.id for d in fn.decorator_list if isinstance(d, ast.Name)}


class Stubs(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tree = stub_tree()
        cls.classes = {n.name: n for n in cls.tree.body if isinstance(n, ast.ClassDef)}

    def test_the_package_ships_py_typed(self):
        self.assertTrue(os.path.isfile(os.path.join(os.path.dirname(dpar.__file__), "py.typed")))

    def test_every_public_name_is_in_the_stub_and_no_other(self):
        stub = set()
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                stub.add(node.name)
            elif isinstance(node, ast.Assign):
                stub.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                stub.add(node.target.id)
        runtime = {n for n in public(dir(dpar)) if not n.startswith("__")
                   and not isinstance(getattr(dpar, n), types.ModuleType)}
        self.assertEqual(public(stub) - {n for n in stub if n.startswith("__")}, runtime)

    def test_constants_are_the_enum_members_they_name(self):
        for node in self.tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute) and \
                    isinstance(node.value.value, ast.Name) and node.value.value.id in self.classes:
                for target in node.targets:
                    with self.subTest(target.id):
                        self.assertIs(getattr(dpar, target.id), getattr(getattr(dpar, node.value.value.id),
                                                                        node.value.attr))

    def test_functions_have_the_same_parameters(self):
        for node in self.tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                with self.subTest(node.name):
                    self.assertEqual(stub_parameters(node), runtime_parameters(getattr(dpar, node.name)))

    def test_enums_have_the_same_members_and_values(self):
        for name, node in self.classes.items():
            runtime = getattr(dpar, name, None)
            if not (isinstance(runtime, type) and issubclass(runtime, enum.IntEnum)):
                continue
            with self.subTest(name):
                stub = {t.targets[0].id: ast.literal_eval(t.value) for t in node.body if isinstance(t, ast.Assign)}
                self.assertEqual(stub, {m.name: int(m) for m in runtime})

    def test_classes_have_the_same_methods_properties_and_parameters(self):
        for name, node in self.classes.items():
            runtime = getattr(dpar, name, None) if not name.startswith("_") else None
            if runtime is None or issubclass(runtime, enum.Enum):
                continue
            # The stub's members, with those of its stub bases (_Handle); the package's, along its own classes.
            members, pending = {}, [node]
            while pending:
                n = pending.pop()
                for m in n.body:
                    if isinstance(m, ast.FunctionDef):
                        members.setdefault(m.name, m)
                pending += [self.classes[b.id] for b in n.bases if isinstance(b, ast.Name) and b.id in self.classes]
            own = set()
            for klass in runtime.__mro__:
                if klass.__module__ == dpar.__name__:
                    own.update(k for k, v in vars(klass).items() if callable(v) or isinstance(v, (property,
                               classmethod, staticmethod)))
            with self.subTest(name):
                self.assertEqual(set(members), public(own))
            for member, fn in members.items():
                with self.subTest(f"{name}.{member}"):
                    attr = inspect.getattr_static(runtime, member)
                    if isinstance(attr, property):
                        self.assertIn("property", decorators(fn))
                        continue
                    self.assertEqual("classmethod" in decorators(fn), isinstance(attr, classmethod))
                    self.assertEqual("staticmethod" in decorators(fn), isinstance(attr, staticmethod))
                    target = attr.__func__ if isinstance(attr, (classmethod, staticmethod)) else attr
                    expected = runtime_parameters(target)
                    got = stub_parameters(fn)
                    if not isinstance(attr, staticmethod):  # self or cls: named as the stub likes
                        expected, got = expected[1:], got[1:]
                    self.assertEqual(got, expected)


if __name__ == "__main__":
    unittest.main()
