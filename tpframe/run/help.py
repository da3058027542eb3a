"""Every config key with its type, default and comment, read from the dataclasses' own source: what
`train.py --help` prints, so the documentation cannot drift from the code.

    for key in config_keys(): print(key.name, key.default, key.comment)   # "parallel.tp", "1", "..."

A key's comment is the `# ...` at the end of its line in the dataclass, or the comment lines right above it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ConfigKey:
    name: str  # section.key
    type: str  # e.g. "int", "float | None", "ddp|zero1|fsdp"
    default: str  # as YAML would write it
    comment: str


def _comments(source: str) -> dict[int, str]:
    """{line number: comment text} of a piece of source."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def _type_name(hint) -> str:
    """A field's type as --help shows it: `int`, `float|None`, `ddp|zero1|fsdp` (a Literal's choices, which may come
    from a registry: `Literal[STRATEGIES]`), `bool|full|selective`."""
    if typing.get_origin(hint) is Literal:
        return "|".join(str(v) for v in typing.get_args(hint))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return "|".join(_type_name(option) for option in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        return f"list[{_type_name(typing.get_args(hint)[0])}]"
    return "None" if hint is type(None) else hint.__name__


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = field.default_factory()  # type: ignore[misc]
    else:
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):  # as an override writes it: one word
        return "[" + ",".join(map(str, value)) + "]"
    if isinstance(value, float) and value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e6):
        return f"{value:g}"
    return str(value)


def section_keys(section: str, cls) -> list[ConfigKey]:
    source = textwrap.dedent(inspect.getsource(cls))
    comments = _comments(source)
    lines = source.splitlines()
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    out = []
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)) or node.target.id not in fields:
            continue
        text = comments.get(node.lineno, "")
        if not text:  # comment lines right above the field
            above, line = [], node.lineno - 1
            while line >= 1 and lines[line - 1].strip().startswith("#"):
                above.insert(0, comments[line])
                line -= 1
            text = " ".join(above)
        name = node.target.id
        out.append(ConfigKey(f"{section}.{name}", _type_name(hints[name]), _default(fields[name]), text))
    return out


def config_keys() -> list[ConfigKey]:
    """Every key of every section of tpframe.training.config.Config, in declaration order."""
    from tpframe.training.config import Config

    sections = typing.get_type_hints(Config)
    return [key for f in dataclasses.fields(Config) for key in section_keys(f.name, sections[f.name])]


def help_table(width: int = 120) -> str:
    """The keys as an aligned table: `section.key  type  default  comment` (comments wrapped)."""
    keys = config_keys()
    w_name = max(len(k.name) for k in keys)
    w_default = min(max(len(k.default) for k in keys), 16)
    rows = [
        "config keys (set in the YAML file or as section.key=value):",
        f"  {'key':{w_name}}  {'default':{w_default}}  type: what",
    ]
    indent = 2 + w_name + 2 + w_default + 2
    for k in keys:
        what = f"{k.type}: {k.comment}" if k.comment else k.type
        wrapped = textwrap.wrap(what, max(40, width - indent)) or [""]
        rows.append(f"  {k.name:{w_name}}  {k.default:{w_default}}  {wrapped[0]}")
        rows += [" " * indent + more for more in wrapped[1:]]
    return "\n".join(rows)
