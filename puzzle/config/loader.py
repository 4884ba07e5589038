"""The generic config loader: plain data (parsed YAML or JSON) into (nested) dataclasses, by their type hints.

`from_data(cls, data)` builds `cls` strictly: an unknown key is an error listing the valid keys at its level
(with a did-you-mean); a missing required key is an error; YAML booleans are not integers; strings are
never read as numbers (write `1e-4` or `1_000_000`, not `"1e-4"`); integers are accepted where a number is
expected and whole numbers (`2e9`) where an integer is; a dataclass's own `__post_init__` checks are
reported with the key's path. A class with `from_dict(data, where)` and `to_dict()` (such as
`puzzle.space.SearchSpace`) loads itself, even a dataclass. Every error is a `ConfigError` naming the
key's path (`bld.lr`, `search.budgets[1]`) and what was expected. `read_yaml` reads YAML numbers as YAML 1.2
does (`1e-4` is a number), refuses a key given twice and keeps each key's line for messages.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config that cannot be used. `key`: the offending key's path (`bld.lr`, `search.budgets[1]`; empty
    for the whole file); `file` and `line`: where it was read, when known; `at`: the path whose line to
    report when it lies deeper than `key` (a key inside an inline search space: `space.kinds.moe.topk`)."""

    def __init__(
        self,
        message: str,
        key: str = "",
        file: str | Path | None = None,
        line: int | None = None,
        at: str | None = None,
    ):
        self.message, self.key, self.file, self.line, self.at = message, key, file, line, at
        super().__init__(self._text())

    def _text(self) -> str:
        where = ""
        if self.file is not None:
            where = f"{self.file}" + (f", line {self.line}" if self.line else "") + ": "
        # A message from another module's validation may already start with the path (`space.kinds...`).
        if self.key and not self._names_key():
            return f"{where}{self.key}: {self.message}"
        return where + self.message

    def _names_key(self) -> bool:
        """Whether the message already starts with the key's path (`space.kinds.moe.top_k[2] must be ...`)."""
        return self.message.startswith(self.key) and self.message[len(self.key) : len(self.key) + 1] in ".[:"

    def within(self, prefix: str) -> ConfigError:
        """The same error with its key under `prefix` (`lr` in section `bld` -> `bld.lr`)."""
        if not prefix:
            return self
        if not self.key:
            key = prefix
        elif self.key.startswith("["):
            key = f"{prefix}{self.key}"
        else:
            key = f"{prefix}.{self.key}"
        message = self.message
        if self.key and self._names_key():
            message = key + message[len(self.key) :]
        at = None if self.at is None else ConfigError("", self.at).within(prefix).key
        return ConfigError(message, key, self.file, self.line, at)


def doc(text: str) -> dict[str, str]:
    """A field's metadata holding its documentation (read by `reference_markdown`)."""
    return {"doc": " ".join(text.split())}


# ----------------------------------------------------------------------------------------------------------
# The generic loader: plain data (from YAML or JSON) -> dataclasses, by type hints.


def show_value(value: Any) -> str:
    """A value as the user wrote it in YAML, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} item(s)"
    return repr(value) if isinstance(value, (int, float)) else type(value).__name__


def is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def describe(tp: Any) -> str:
    """What a value of type `tp` is, in words ("an integer", "a list of strings", "one of 'a', 'b'")."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp is Path:
        return "a path"
    if tp is Any:
        return "any value"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if is_union(tp):
        parts = [describe(a) for a in args if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in args else "")
    if origin in (tuple, list, Sequence):
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"a list of {len(args)} items ({', '.join(describe(a) for a in args)})"
        return f"a list (each {describe(args[0])})" if args else "a list"
    if origin in (dict, Mapping):
        return f"a mapping of names to {describe(args[1])}" if args else "a mapping"
    if dataclasses.is_dataclass(tp) or _loads_itself(tp):
        return f"a mapping (a {tp.__name__} section)"
    return getattr(tp, "__name__", str(tp))


def type_name(tp: Any) -> str:
    """A short type for the reference page: `int`, `float | null`, `list[str]`, `'a' | 'b'`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Path:
        return "path"
    if tp is type(None):
        return "null"
    if origin is Literal:
        return " \\| ".join(repr(a) for a in args)
    if is_union(tp):
        return " \\| ".join(type_name(a) for a in args)
    if origin in (tuple, list, Sequence):
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"[{', '.join(type_name(a) for a in args)}]"
        return f"list[{type_name(args[0])}]"
    if origin in (dict, Mapping):
        return f"mapping[{type_name(args[0])}, {type_name(args[1])}]"
    return getattr(tp, "__name__", str(tp))


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _loads_itself(tp: Any) -> bool:
    """A class with `from_dict(data, where)` and `to_dict()` (such as SearchSpace) validates its own data."""
    if not isinstance(tp, type) or not callable(getattr(tp, "to_dict", None)):
        return False
    try:
        parameters = list(inspect.signature(tp.from_dict).parameters)
    except (AttributeError, TypeError, ValueError):
        return False
    return parameters == ["data", "where"]


def _kind(tp: Any) -> str:
    """Which YAML shape a type takes: 'mapping', 'list', 'str', 'number', 'bool', 'null' or 'any'."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp) or _loads_itself(tp) or origin in (dict, Mapping):
        return "mapping"
    if origin in (tuple, list, Sequence):
        return "list"
    if tp in (str, Path) or (origin is Literal and all(isinstance(a, str) for a in typing.get_args(tp))):
        return "str"
    if tp in (int, float):
        return "number"
    return {bool: "bool", type(None): "null"}.get(tp, "any")


def _kind_of(value: Any) -> str:
    if isinstance(value, Mapping):
        return "mapping"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, str):
        return "str"
    if isinstance(value, bool):
        return "bool"
    return "null" if value is None else "number" if isinstance(value, (int, float)) else "any"


def from_data(cls: type[T], data: Any, key: str = "", base_dir: str | Path | None = None) -> T:
    """`data` (plain dicts, lists, numbers, strings: parsed YAML or JSON) as type `cls`, strictly checked.

    `cls` is a dataclass (or any type `describe` knows); `key` is the path of `data` in the file, used in
    messages; `base_dir` is where relative paths are resolved (the config file's folder; None leaves them
    relative to the working directory). Raises ConfigError naming the key's path.
    """
    return _convert(cls, data, key, Path(base_dir) if base_dir is not None else None)


def join_key(key: str, name: str | int) -> str:
    """The path of `name` under `key`: `bld` + `lr` -> `bld.lr`, `search.budgets` + 1 -> `search.budgets[1]`."""
    if isinstance(name, int):
        return f"{key}[{name}]"
    return f"{key}.{name}" if key else name


def _convert(tp: Any, value: Any, key: str, base_dir: Path | None) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if is_union(tp):
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"expected {describe(tp)}, got null", key)
        arms = [a for a in args if a is not type(None)]
        matching = [a for a in arms if _kind(a) in (_kind_of(value), "any")]
        if len(matching) == 1:  # the shape decides: its errors are the ones to report
            return _convert(matching[0], value, key, base_dir)
        for arm in matching:
            try:
                return _convert(arm, value, key, base_dir)
            except ConfigError:
                continue
        raise ConfigError(f"expected {describe(tp)}, got {show_value(value)}", key)
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        hint = ""
        if isinstance(value, str):
            close = difflib.get_close_matches(value, [a for a in args if isinstance(a, str)], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"expected one of {', '.join(repr(a) for a in args)}, got {show_value(value)}{hint}", key
        )
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"expected true or false, got {show_value(value)}", key)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"expected an integer, got {show_value(value)}", key)
        if isinstance(value, float):
            if not (math.isfinite(value) and value.is_integer()):
                raise ConfigError(f"expected an integer, got {show_value(value)}", key)
            return int(value)  # `2e9` reads as a float in YAML: a whole number is an integer
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"expected a number, got {show_value(value)}", key)
        if not math.isfinite(value):
            raise ConfigError(f"expected a finite number, got {show_value(value)}", key)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"expected a string, got {show_value(value)}", key)
        return value
    if tp is Path:
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"expected a path (a non-empty string), got {show_value(value)}", key)
        path = Path(value).expanduser()
        return base_dir / path if base_dir is not None and not path.is_absolute() else path
    if origin in (tuple, list, Sequence):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"expected {describe(tp)}, got {show_value(value)}", key)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"expected {describe(tp)}, got {len(value)} item(s)", key)
            items = [_convert(a, v, join_key(key, i), base_dir) for i, (a, v) in enumerate(zip(args, value))]
        else:
            item_type = args[0] if args else Any
            items = [_convert(item_type, v, join_key(key, i), base_dir) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"expected {describe(tp)}, got {show_value(value)}", key)
        out = {}
        for name, item in value.items():
            if not isinstance(name, str):
                raise ConfigError(f"keys must be strings, found {show_value(name)}", key)
            out[name] = _convert(args[1] if args else Any, item, join_key(key, name), base_dir)
        return out
    if _loads_itself(tp):
        try:
            return tp.from_dict(value, key or tp.__name__)
        except ValueError as error:  # its own messages start with the key's path
            raise ConfigError(str(error), key, at=error_key(error, key)) from None
    if dataclasses.is_dataclass(tp):
        return _load_dataclass(tp, value, key, base_dir)
    raise TypeError(f"the config loader cannot read type {tp!r} (at {key or 'the top level'})")


def _load_dataclass(cls: type, value: Any, key: str, base_dir: Path | None) -> Any:
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    where = f"in {key}" if key else "at the top level"
    if not isinstance(value, Mapping):
        raise ConfigError(f"expected a mapping with keys {', '.join(names)}; got {show_value(value)}", key)
    for name in value:
        if not isinstance(name, str):
            raise ConfigError(f"keys must be strings, found {show_value(name)} {where}", key)
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"unknown key; {hint}valid keys {where}: {', '.join(names)}", join_key(key, name)
            )
    hints = type_hints(cls)
    kwargs = {}
    for item in dataclasses.fields(cls):
        if not item.init:
            continue
        if item.name in value:
            kwargs[item.name] = _convert(
                hints[item.name], value[item.name], join_key(key, item.name), base_dir
            )
        elif item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING:
            raise ConfigError(
                f"missing (required): expected {describe(hints[item.name])}", join_key(key, item.name)
            )
    try:
        return cls(**kwargs)
    except ConfigError as error:
        raise error.within(key) from None
    except (ValueError, TypeError) as error:  # the class's own checks (SpecError, BudgetError...)
        raise _translated(cls, str(error), key, value) from None


def _translated(cls: type, message: str, key: str, given: Mapping[str, Any]) -> ConfigError:
    """A __post_init__ message in the config's terms: `BLDSettings.lr must be a positive number, found -1.0`
    in section `bld` reads `bld.lr: expected a positive number, got -1` (the value as written)."""
    owner = re.escape(cls.__name__)
    fields_pattern = "|".join(re.escape(f.name) for f in dataclasses.fields(cls))
    match = re.fullmatch(rf"{owner}\.({fields_pattern}) must be (.*), found (.*)", message, re.S)
    if match:
        name, expected, found = match.groups()
        if expected[:1] in "<>=!":  # `must be >= 1` -> `expected a value >= 1`
            expected = f"a value {expected}"
        written = given.get(name)
        if isinstance(written, (int, float)) and not isinstance(written, bool) and _reads_as(found, written):
            found = repr(written)  # -1, not the -1.0 it became
        return ConfigError(f"expected {expected}, got {found}", join_key(key, name))
    # `Owner.field message`, `Owner.field: message` or `Owner.field.NAME.sub: message` (a path into the field)
    match = re.match(rf"{owner}\.((?:{fields_pattern})\b(?:\.[\w.-]+)?):?\s*(.*)", message, re.S)
    if match:
        return ConfigError(match.group(2), join_key(key, match.group(1)))
    text = re.sub(rf"^{owner}:?\s*", "", message)
    return ConfigError(text, key)


def _reads_as(text: str, number: float) -> bool:
    try:
        return float(text) == number
    except ValueError:
        return False


def to_dict(value: Any) -> Any:
    """Plain data (dicts, lists, numbers, strings) that `from_data` reads back into an equal object."""
    if _loads_itself(type(value)):
        return value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_dict(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [to_dict(v) for v in value]
    if isinstance(value, Mapping):
        return {k: to_dict(v) for k, v in value.items()}
    return value


# ----------------------------------------------------------------------------------------------------------
# YAML: numbers as YAML 1.2 reads them, duplicate keys refused, the line of every key kept for messages.


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats (`1e-4` is a number) that refuses a key given twice."""

    yaml_implicit_resolvers: typing.ClassVar = {
        k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            name = self.construct_object(key_node, deep=True)
            if not isinstance(name, (str, int, float, bool)):
                continue  # an unhashable key: the base class reports it
            if name in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {name!r} given twice (first on line {seen[name]})", key_node.start_mark
                )
            seen[name] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _key_lines(node: yaml.Node | None, prefix: str, lines: dict[str, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                child = join_key(prefix, key_node.value)
                lines[child] = key_node.start_mark.line + 1
                _key_lines(value_node, child, lines)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            child = join_key(prefix, index)
            lines[child] = item.start_mark.line + 1
            _key_lines(item, child, lines)


def read_yaml(path: str | Path) -> tuple[Any, dict[str, int]]:
    """(data, {key path: line}) of a YAML file; ConfigError naming the file (and line) when it cannot be read."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"not a text file (byte {error.start} is not UTF-8)", file=path) from None
    except IsADirectoryError:
        raise ConfigError("is a directory; expected a YAML file", file=path) from None
    except OSError as error:
        raise ConfigError(f"cannot read the config: {error.strerror or error}", file=path) from None
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        data = None if node is None else loader.construct_document(node)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        problem = " ".join(filter(None, [error.context, error.problem]))
        raise ConfigError(
            f"not valid YAML: {problem}", file=path, line=mark.line + 1 if mark else None
        ) from None
    except yaml.YAMLError as error:
        raise ConfigError(f"not valid YAML: {error}", file=path) from None
    finally:
        loader.dispose()
    lines: dict[str, int] = {}
    _key_lines(node, "", lines)
    return data, lines


def error_key(error: Exception, key: str) -> str:
    """The path of the key that an error of a class loading itself from `key` (`SearchSpace.from_dict`) is
    about, for its line: the error's own `key` (an unknown key's path: `space.kinds.moe.topk`), else the path
    its message starts with (`space.kinds.moe.top_k[2] must be ...`) when it lies under `key`, else `key`."""
    own = getattr(error, "key", None)
    if isinstance(own, str) and own:
        return own
    match = re.match(r"[\w.\[\]]+", str(error))
    path = match.group(0).rstrip(".") if match else ""
    return path if path.startswith((f"{key}.", f"{key}[")) else key


def line_of(key: str, lines: Mapping[str, int]) -> int | None:
    while key:
        if key in lines:
            return lines[key]
        parent = re.sub(r"(\.[^.\[\]]+|\[\d+\])$", "", key)
        if parent == key:
            break
        key = parent
    return None
