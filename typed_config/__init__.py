"""The one configuration loader: a TOML file (then environment, then flags) into a typed dataclass.

Agent and router (and the cluster launcher's tables) describe their settings as a dataclass; this
module turns a TOML document into it. Every value is checked against the field's annotation when it
is loaded, so a misspelt key, a string where a number belongs or a missing required setting fails at
start with a message naming the file, the key and the expected type, rather than later with
"'<' not supported". A field without a default is required.

Supported annotations: str, int, float, bool, Path, `X | None`, list[X], dict[str, X], a bare dict
(a table passed through) and `X | list[X]` (one value or several; as text, commas separate several).
TOML has no null, so `X | None` is None only when left out or given as "none" in the environment or
on the command line.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import types
import typing
from pathlib import Path


class ConfigError(ValueError):
    """A configuration is unusable; the message names where (file, variable or flag), the key and the fix."""


def fields_of(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def hint_of(cls, name: str):
    return typing.get_type_hints(cls)[name]


def base_type(cls, name: str) -> type:
    """The field's type without `| None` and without its parameters (list, dict, int, ...); of
    `X | list[X]`, X."""
    hint = _strip_none(hint_of(cls, name))
    if _is_union(hint):
        hint = typing.get_args(hint)[0]
    return typing.get_origin(hint) or hint


def read_toml(path: str | Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None


def check_values(cls, values: dict, where: str) -> dict:
    """`values` with every key a field of `cls` and every value of its type (ints widened to float)."""
    known = fields_of(cls)
    checked = {}
    for name, value in values.items():
        if name not in known:
            raise ConfigError(f"{where}: {name}: unknown setting (known: {', '.join(known)})")
        checked[name] = check_value(hint_of(cls, name), value, f"{where}: {name}")
    return checked


def build(cls, values: dict, where: str):
    """A `cls` from already type-checked values; refuses missing required settings, runs `validate()`."""
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in values and _required(f)]
    if missing:
        raise ConfigError(f"{where}: missing required setting(s): {', '.join(missing)}")
    config = cls(**values)
    validate = getattr(config, "validate", None)
    if validate is not None:
        try:
            validate()
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return config


def load(cls, path: str | Path | None = None, *, table: str | None = None, env_prefix: str | None = None,
         environ: dict[str, str] | None = None, overrides: dict | None = None):
    """A `cls` from the TOML file at `path` (its `[table]` if given and present, else the top level),
    then `<env_prefix><FIELD>` environment variables, then `overrides` (flag values, later wins)."""
    values: dict = {}
    where = str(path) if path is not None else "config"
    if path is not None:
        document = read_toml(path)
        if table is not None and table in document:
            extra = sorted(set(document) - {table})
            if extra:
                raise ConfigError(f"{path}: {', '.join(extra)}: unknown setting(s) outside the [{table}] table")
            document = document[table]
            if not isinstance(document, dict):
                raise ConfigError(f"{path}: {table}: must be a table")
        values.update(check_values(cls, document, str(path)))
    if env_prefix is not None:
        environ = os.environ if environ is None else environ
        for name in fields_of(cls):
            text = environ.get(env_prefix + name.upper())
            if text is not None:
                values[name] = parse_text(cls, name, text, f"environment {env_prefix + name.upper()}")
    known = fields_of(cls)
    for name, value in (overrides or {}).items():
        flag = f"--{name.replace('_', '-')}"
        if name not in known:
            raise ConfigError(f"{flag}: unknown setting")
        values[name] = check_value(hint_of(cls, name), value, flag)
    return build(cls, values, where)


def check_value(hint, value, where: str):
    """`value` as a TOML (or already typed) value of the annotation `hint`, or a ConfigError."""
    if _is_optional(hint) and value is None:
        return None
    hint = _strip_none(hint)
    if _is_union(hint):
        return _check_union(hint, value, where)
    origin, args = typing.get_origin(hint) or hint, typing.get_args(hint)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise _wrong_type(where, _describe(hint), value)
        return [check_value(args[0], item, f"{where}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _wrong_type(where, _describe(hint), value)
        if not args:
            return dict(value)
        return {key: check_value(args[1], item, f"{where}.{key}") for key, item in value.items()}
    if origin is Path:
        if isinstance(value, Path):
            return value
        if not isinstance(value, str):
            raise _wrong_type(where, "path", value)
        return Path(value)
    if origin is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _wrong_type(where, "float", value)
        if not math.isfinite(value):
            raise ConfigError(f"{where}: must be a finite number, got {value!r}")
        return float(value)
    if not isinstance(origin, type):
        raise TypeError(f"typed_config cannot check the annotation {hint!r} ({where}); use one listed in its docstring")
    if origin is int and isinstance(value, bool) or not isinstance(value, origin):
        raise _wrong_type(where, origin.__name__, value)
    return value


def parse_text(cls, name: str, text: str, where: str):
    """A setting given as text (environment variable, command-line flag) converted to the field's type.

    Lists are comma-separated; dicts are comma-separated KEY=VALUE pairs; "none" or "" is None
    for an optional setting."""
    hint = hint_of(cls, name)
    if _is_optional(hint) and text.strip().lower() in ("", "none"):
        return None
    return check_value(hint, _text_value(_strip_none(hint), text, where), where)


def parse_pairs(items: list[str], where: str) -> dict[str, str]:
    """KEY=VALUE items (blank ones skipped) as a dict."""
    pairs = {}
    for item in (i.strip() for i in items):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ConfigError(f"{where}: expected KEY=VALUE, got {item!r}")
        pairs[key.strip()] = value.strip()
    return pairs


def _text_value(hint, text: str, where: str):
    if _is_union(hint):  # X | list[X]: several values when the text has commas
        one, many = typing.get_args(hint)
        return _text_value(many if "," in text else one, text, where)
    origin, args = typing.get_origin(hint) or hint, typing.get_args(hint)
    if origin is list:
        return [_text_value(args[0], item.strip(), where) for item in text.split(",") if item.strip()]
    if origin is dict:
        return parse_pairs(text.split(","), where)
    if origin is bool:
        lowered = text.strip().lower()
        if lowered not in ("true", "false", "1", "0", "yes", "no"):
            raise ConfigError(f"{where}: must be bool (true or false), got {text!r}")
        return lowered in ("true", "1", "yes")
    if origin in (int, float):
        try:
            return origin(text)
        except ValueError:
            raise ConfigError(f"{where}: must be {origin.__name__}, got {text!r}") from None
    return text


def check_listen(name: str, listen: str) -> None:
    """A `host:port` listen setting: a host (an IPv6 one in brackets) and a port in [0, 65535] (0: any free one)."""
    host, _, port = listen.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ConfigError(f"{name}: expected host:port such as 127.0.0.1:9401, got {listen!r}")


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _is_optional(hint) -> bool:
    return isinstance(hint, types.UnionType) and type(None) in typing.get_args(hint)


def _is_union(hint) -> bool:
    return isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union


def _check_union(hint, value, where: str):
    members = typing.get_args(hint)
    for member in members:
        try:
            return check_value(member, value, where)
        except ConfigError:
            continue
    expected = " or ".join(_describe(m) for m in members)
    raise _wrong_type(where, expected, value)


def _strip_none(hint):
    if _is_optional(hint):
        rest = [t for t in typing.get_args(hint) if t is not type(None)]
        return rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]
    return hint


def _describe(hint) -> str:
    origin, args = typing.get_origin(hint) or hint, typing.get_args(hint)
    if origin is list:
        return f"a list of {_describe(args[0]).removeprefix('a ')}"
    if origin is dict:
        return f"a table of {_describe(args[1])}" if args else "a table"
    return getattr(origin, "__name__", str(origin))


def _wrong_type(where: str, expected: str, value) -> ConfigError:
    return ConfigError(f"{where}: must be {expected}, got {_toml_type(value)} {value!r}")


def _toml_type(value) -> str:
    if isinstance(value, dict):
        return "table"
    if isinstance(value, (list, tuple)):
        return "list"
    return type(value).__name__
