"""Griffe extension for the API reference (loaded from ``mkdocs.yml``); changes nothing in the package.

The docstrings are written for readers of the source and use Sphinx roles (``:class:`X```,
``:meth:`Publisher.publish```, ``:mod:`.worker```). mkdocstrings renders Markdown, where such a
role would show as text. At render time this extension

* turns each role into an autorefs cross-reference: the name is resolved the way Python would
  see it from the documented object (its own members, its parents', the module's imports, then
  the ``deltastore`` package), and linked when the target is rendered somewhere in the site;
  otherwise it is shown as code (a private helper, a builtin such as ``ValueError``);
* replaces a parameter default that names a module constant (``max_object_bytes:
  int = DEFAULT_MAX_OBJECT_BYTES``) by the constant's value as written (``1 << 30``) when that
  value is a plain literal, so the signature shows the real default;
* splits a Google-style argument entry that names several parameters at once
  (``codec, anchor: passed to the Publisher.``) into one entry per parameter;
* ends a paragraph's reST literal-block marker ``::`` with one colon, as Sphinx shows it;
* documents a class that a module builds lazily in a factory function (to import an optional
  dependency on first use) and declares for type checkers only, like
  ``deltastore.integrations.trl.DeltaStoreCallback``: the declaration gets the docstrings,
  defaults and bases of the class the factory defines.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import griffe

# :class:`X`, :meth:`~a.b.C.m`, :py:func:`f`, :class:`title <a.b.C>`
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`(?P<body>[^`]+)`")
_TITLED = re.compile(r"^(?P<title>.*?)\s*<(?P<target>[^<>]+)>$")
_LITERAL_BLOCK = re.compile(r"(?<=\S)::$", re.MULTILINE)  # "text::" closing a paragraph
_ARGS_SECTION = re.compile(r"^(Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments|Other Parameters):\s*$")
_GROUPED_ARG = re.compile(r"^(?P<indent>\s+)(?P<names>\*{0,2}\w+(?:,\s*\*{0,2}\w+)+):\s(?P<text>.*)$")
_LITERAL_NODES = (ast.Expression, ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop, ast.Dict,
                  ast.List, ast.Tuple, ast.Set, ast.Load)
ROOT_PACKAGE = "deltastore"


class ApiReference(griffe.Extension):
    """Runs once the `deltastore` package is loaded: every change listed in the module docstring."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != ROOT_PACKAGE:
            return
        collection = loader.modules_collection
        objects = list(_walk(pkg))
        for obj in objects:
            if obj.is_module:
                _document_lazy_classes(obj)
        names = _public_names(objects)
        for obj in objects:
            if obj.docstring is not None and ":" in obj.docstring.value:
                text = ROLE.sub(lambda m, o=obj: _reference(m["body"], o, collection, names), obj.docstring.value)
                obj.docstring.value = _split_grouped_args(_LITERAL_BLOCK.sub(":", text))
            if obj.is_function:
                for param in obj.parameters:
                    value = _constant_value(param.default, obj, collection)
                    if value is not None:
                        param.default = value


def _walk(obj: griffe.Object):
    """The object and every member defined in the package (aliases are documented where they point)."""
    yield obj
    for member in list(obj.members.values()):
        if not member.is_alias:
            yield from _walk(member)


def _public_names(objects: list[griffe.Object]) -> dict[str, str | None]:
    """Each public class and function name of the package -> its path (None where two share a name)."""
    names: dict[str, str | None] = {}
    for obj in objects:
        if (obj.is_class or obj.is_function) and not obj.name.startswith("_") and obj.parent.is_module:
            names[obj.name] = obj.path if names.get(obj.name, obj.path) == obj.path else None
    return names


def _reference(body: str, scope: griffe.Object, collection: Any, names: dict[str, str | None]) -> str:
    """Markdown for one role: an optional autoref where the name resolves, else inline code."""
    body = body.strip()
    titled = _TITLED.match(body)
    if titled:
        title, target = titled["title"], titled["target"].strip()
    else:
        target = body
        title = None
    short = target.startswith("~")
    target = target.lstrip("~")
    if title is None:
        title = target.rsplit(".", 1)[-1] if short else target.lstrip(".")
    path = _resolve(target, scope, collection, names)
    code = f"`{title}`"
    if path is None:
        return code
    return f'<autoref identifier="{path}" optional>{code}</autoref>'


def _resolve(target: str, scope: griffe.Object, collection: Any, names: dict[str, str | None]) -> str | None:
    """The canonical path of the object ``target`` names, seen from ``scope``; None if it names none."""
    candidates: list[str] = []
    if target.startswith("."):  # relative to the documented object's package (``:mod:`.worker```)
        module = scope if scope.is_module else scope.module
        package = module if module.is_init_module else module.parent
        candidates.append(f"{package.path}.{target.lstrip('.')}")
    else:
        first, _, rest = target.partition(".")
        try:
            base = scope.resolve(first)
        except (griffe.NameResolutionError, griffe.AliasResolutionError, AttributeError):
            base = None
        if base is not None:
            candidates.append(f"{base}.{rest}" if rest else base)
        candidates += [target, f"{ROOT_PACKAGE}.{target}"]
        if names.get(first):  # a name the package defines once, wherever it is imported from
            candidates.append(f"{names[first]}.{rest}" if rest else names[first])
    for candidate in candidates:
        try:
            found = collection[candidate]
            return found.canonical_path
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError, ValueError):
            continue
    return None


def _constant_value(default: Any, function: griffe.Function, collection: Any) -> str | None:
    """The literal value of the module constant a default names, as written; None if it is not one."""
    if not isinstance(default, griffe.ExprName):
        return None
    scope = function.parent or function
    try:
        found = collection[scope.resolve(default.name)]
        found = found.final_target if found.is_alias else found
    except (KeyError, griffe.NameResolutionError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None
    if not found.is_attribute or found.value is None:
        return None
    text = str(found.value)
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return None
    if not all(isinstance(node, _LITERAL_NODES) for node in ast.walk(tree)):
        return None
    return text


def _document_lazy_classes(module: griffe.Module) -> None:
    """Give each undocumented class of ``module`` that a module-level function also defines that definition's
    docstrings, ``__init__`` defaults and bases (names imported inside the function are written in full)."""
    stubs = {name: obj for name, obj in module.members.items()
             if not obj.is_alias and obj.is_class and obj.docstring is None}
    if not stubs or not isinstance(module.filepath, Path):
        return
    tree = ast.parse(module.filepath.read_text())
    template = module.docstring
    for factory in (node for node in tree.body if isinstance(node, ast.FunctionDef)):
        imported = {alias.asname or alias.name: f"{node.module}.{alias.name}" for node in ast.walk(factory)
                    if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}
        for real in (node for node in ast.walk(factory) if isinstance(node, ast.ClassDef) and node.name in stubs):
            stub = stubs.pop(real.name)
            _copy_docstring(stub, real, template)
            stub.bases = [imported.get(ast.unparse(base), ast.unparse(base)) for base in real.bases]
            for method in (node for node in real.body if isinstance(node, ast.FunctionDef)):
                target = stub.members.get(method.name)
                if target is None or target.is_alias or not target.is_function:
                    continue
                if target.docstring is None:
                    _copy_docstring(target, method, template)
                for name, default in _defaults(method.args).items():
                    if name in target.parameters:
                        target.parameters[name].default = default


def _copy_docstring(obj: griffe.Object, node: ast.ClassDef | ast.FunctionDef, template: Any) -> None:
    text = ast.get_docstring(node)
    if text:
        obj.docstring = griffe.Docstring(text, lineno=node.body[0].lineno, parent=obj,
                                         parser=template.parser if template else None,
                                         parser_options=template.parser_options if template else None)


def _defaults(args: ast.arguments) -> dict[str, str]:
    positional = args.posonlyargs + args.args
    out = {a.arg: ast.unparse(d) for a, d in zip(positional[len(positional) - len(args.defaults):], args.defaults)}
    out.update({a.arg: ast.unparse(d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None})
    return out


def _split_grouped_args(text: str) -> str:
    """``a, b: text`` in an arguments section -> ``a: text`` and ``b: text``."""
    out, in_args = [], False
    for line in text.split("\n"):
        if not line.startswith((" ", "\t")) and line.strip():
            in_args = bool(_ARGS_SECTION.match(line))
        grouped = _GROUPED_ARG.match(line) if in_args else None
        if grouped:
            names = [n.strip() for n in grouped["names"].split(",")]
            out += [f"{grouped['indent']}{name}: {grouped['text']}" for name in names]
        else:
            out.append(line)
    return "\n".join(out)
