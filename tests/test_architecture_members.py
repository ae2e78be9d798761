"""Members live in their class: no class body binds a name to a function imported from another module
(``train = _training.train``, ``prop = property(_parts.prop)``), and no class decorator copies in the
members of another class (the former ``@answers_for("_process", ProcessView)``). Such members are invisible
to type checkers and grep; a one-line method that calls the module's function is the way to delegate.

Each rule is a function over parsed source, tested on synthetic modules (it can fail), then run over
``src/lockstep``. The file-length cap, with its higher cap for the files of one-line delegations, is
``tests/test_architecture.py``'s.
"""

from __future__ import annotations

import ast

from tests.test_architecture import Module, package_modules, parse

_WRAPPERS = {"property", "staticmethod", "classmethod"}


def _imported_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def _is_function_name(name: str) -> bool:
    """A function's spelling: lower case, not a CONSTANT and not a Class (enum members are values)."""
    return name[:1].islower() or (name[:1] == "_" and name[1:2].islower())


def _imported_function(value: ast.expr, imported: set[str]) -> bool:
    """``f`` or ``module.f`` (also inside ``property(...)`` and the like) where the root name is imported."""
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in _WRAPPERS:
        return any(_imported_function(arg, imported) for arg in value.args)
    if isinstance(value, ast.Name):
        return value.id in imported and _is_function_name(value.id)
    if isinstance(value, ast.Attribute) and _is_function_name(value.attr):
        root = value.value
        while isinstance(root, ast.Attribute):
            root = root.value
        return isinstance(root, ast.Name) and root.id in imported and _is_function_name(root.id)
    return False


def class_body_bindings(modules: list[Module]) -> list[str]:
    """``Class.member`` for every class-body assignment of an imported function."""
    found = []
    for module in modules:
        imported = _imported_names(module.tree)
        for cls in ast.walk(module.tree):
            if not isinstance(cls, ast.ClassDef):
                continue
            for statement in cls.body:
                if isinstance(statement, ast.Assign):
                    targets, value = statement.targets, statement.value
                elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
                    targets, value = [statement.target], statement.value
                else:
                    continue
                if _imported_function(value, imported):
                    found += [f"{module.name}.{cls.name}.{ast.unparse(t)}" for t in targets]
    return found


def member_copying_decorators(modules: list[Module]) -> list[str]:
    """``Class: @decorator`` for every class decorator given another class (a Capitalized name), the shape of
    a decorator that copies that class's members onto the decorated one."""
    found = []
    for module in modules:
        for cls in ast.walk(module.tree):
            if not isinstance(cls, ast.ClassDef):
                continue
            for decorator in cls.decorator_list:
                if not isinstance(decorator, ast.Call):
                    continue
                arguments = [*decorator.args, *(k.value for k in decorator.keywords)]
                if any(isinstance(a, ast.Name) and a.id[:1].isupper() for a in arguments):
                    found.append(f"{module.name}.{cls.name}: @{ast.unparse(decorator)}")
    return found


def members_set_from_outside(modules: list[Module]) -> list[str]:
    """``setattr(Class, ...)`` and ``Class.member = ...`` outside the class, for a class of the module (its
    own methods may set class state)."""
    found = []
    for module in modules:
        class_nodes = [node for node in ast.walk(module.tree) if isinstance(node, ast.ClassDef)]
        classes = {node.name for node in class_nodes}
        inside = {id(node) for cls in class_nodes for node in ast.walk(cls)}
        for node in ast.walk(module.tree):
            if id(node) in inside:
                continue
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "setattr"
                and node.args
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id in classes
            ):
                found.append(f"{module.name}: {ast.unparse(node)}")
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id in classes
                    ):
                        found.append(f"{module.name}: {ast.unparse(target)} = ...")
    return found


# -- run over src/lockstep ------------------------------------------------------------------------------
def test_no_class_body_binds_an_imported_function():
    assert class_body_bindings(package_modules()) == []


def test_no_class_decorator_copies_another_class_in():
    assert member_copying_decorators(package_modules()) == []


def test_no_member_is_set_on_a_class_from_outside_it():
    assert members_set_from_outside(package_modules()) == []


# -- the rules can fail ---------------------------------------------------------------------------------
def test_the_rules_catch_synthetic_violations():
    source = (
        "from lockstep import _parts\nfrom lockstep._parts import helper\nfrom lockstep.enums import Kind\n"
        "from lockstep.parts import answers_for, View\n"
        "@answers_for('_view', View)\n"
        "class Host:\n"
        "    train = _parts.train\n"
        "    helped: object = helper\n"
        "    size = property(_parts.size)\n"
        "    kind = Kind.NO\n"  # a value, not a member from elsewhere
        "    DEFAULT = _parts.DEFAULT\n"
        "    def run(self):\n"
        "        return _parts.run(self)\n"  # the way to delegate
        "setattr(Host, 'extra', helper)\n"
        "Host.more = helper\n"
    )
    module = parse("lockstep.fake", source)
    assert class_body_bindings([module]) == [
        "lockstep.fake.Host.train",
        "lockstep.fake.Host.helped",
        "lockstep.fake.Host.size",
    ]
    assert member_copying_decorators([module]) == ["lockstep.fake.Host: @answers_for('_view', View)"]
    assert sorted(members_set_from_outside([module])) == [
        "lockstep.fake: Host.more = ...",
        "lockstep.fake: setattr(Host, 'extra', helper)",
    ]
    clean = parse(
        "lockstep.clean",
        "from dataclasses import dataclass\n@dataclass(kw_only=True)\nclass A:\n    x: int = 0\n",
    )
    assert (class_body_bindings([clean]), member_copying_decorators([clean])) == ([], [])
