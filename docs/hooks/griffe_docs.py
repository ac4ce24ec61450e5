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
  value is a plain literal, so the signature shows the real default.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import griffe

# :class:`X`, :meth:`~a.b.C.m`, :py:func:`f`, :class:`title <a.b.C>`
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`(?P<body>[^`]+)`")
_TITLED = re.compile(r"^(?P<title>.*?)\s*<(?P<target>[^<>]+)>$")
_LITERAL_NODES = (ast.Expression, ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop, ast.Dict,
                  ast.List, ast.Tuple, ast.Set, ast.Load)
ROOT_PACKAGE = "deltastore"


class SphinxRolesAndDefaults(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != ROOT_PACKAGE:
            return
        collection = loader.modules_collection
        for obj in _walk(pkg):
            if obj.docstring is not None and ":" in obj.docstring.value:
                obj.docstring.value = ROLE.sub(lambda m, o=obj: _reference(m["body"], o, collection),
                                               obj.docstring.value)
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


def _reference(body: str, scope: griffe.Object, collection: Any) -> str:
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
    path = _resolve(target, scope, collection)
    code = f"`{title}`"
    if path is None:
        return code
    return f'<autoref identifier="{path}" optional>{code}</autoref>'


def _resolve(target: str, scope: griffe.Object, collection: Any) -> str | None:
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
