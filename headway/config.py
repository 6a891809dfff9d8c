"""Typed configs: dataclass sections read from a YAML file plus ``section.key=value`` overrides.

A run config is a dataclass whose fields are *sections* (``target``, ``data``, ``train``, ...),
each a dataclass of typed fields with their own help text. A YAML recipe and command-line
overrides go through the same path: both become ``--key value`` arguments of one
:class:`transformers.HfArgumentParser` per section, so types, choices and booleans are checked
by one parser, and ``__post_init__`` checks cross-field constraints. Unknown sections and keys
are rejected with the nearest valid name.

Example::

    config = load_config(RunConfig, "configs/medusa1-smollm2.yaml", ["train.lr=3e-4"])

The training run's sections live in :mod:`headway.run_config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn, TypeVar

import yaml

from headway.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T")
_NULLS = {"null", "none", "~"}


def field_help(text: str, **metadata: Any) -> dict[str, Any]:
    """A dataclass field's metadata with its help text (read by :func:`describe`)."""
    return {"help": text, **metadata}


def _section_parser(section_type: type[Any], where: str, section: str) -> argparse.ArgumentParser:
    """transformers' ``HfArgumentParser`` for ``section_type``, raising :class:`ConfigError`
    instead of exiting the process (transformers imported here, not when the module loads:
    ``headway --help`` reads this module)."""
    from transformers import HfArgumentParser

    class SectionParser(HfArgumentParser):
        def error(self, message: str) -> NoReturn:
            raise ConfigError(f"{where}: {_readable(message, section)}")

    return SectionParser(typing.cast(Any, section_type), exit_on_error=False, add_help=False)


def _readable(message: str, section: str) -> str:
    """``argument --lr: invalid float value`` -> ``train.lr: invalid float value``, on one line
    (a value with a line break in it is quoted back by argparse and transformers' parser)."""
    named = re.sub(r"argument --(\w+)(/--[\w-]+)?", lambda m: f"{section}.{m.group(1)}", message)
    return " ".join(named.split())


def _section_types(config_type: type[Any]) -> dict[str, type[Any]]:
    hints = typing.get_type_hints(config_type)
    return {f.name: hints[f.name] for f in dataclasses.fields(config_type)}


def _field_types(section_type: type[Any]) -> dict[str, Any]:
    hints = typing.get_type_hints(section_type)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_type) if f.init}


def _is_list(annotation: object) -> bool:
    return typing.get_origin(annotation) is list


def _is_optional(annotation: object) -> bool:
    origin = typing.get_origin(annotation)
    is_union = origin is typing.Union or origin is types.UnionType
    return is_union and type(None) in typing.get_args(annotation)


def unknown_name(kind: str, name: str, valid: Sequence[str], where: str) -> ConfigError:
    """The error for an unknown ``name`` of ``kind`` (section, key, option), with the nearest
    valid name, else every valid one."""
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"valid: {', '.join(sorted(valid))}"
    return ConfigError(f"{where}: unknown {kind} {name!r}; {hint}")


def _as_argument(value: object) -> list[str]:
    """One YAML value as argparse tokens: lists become several tokens, booleans 'true'/'false'."""
    if isinstance(value, bool):
        return ["true" if value else "false"]
    if isinstance(value, list | tuple):
        return [token for item in value for token in _as_argument(item)]
    if isinstance(value, Mapping):
        raise ConfigError(f"nested mapping {dict(value)!r} where a value was expected")
    return [str(value)]


def parse_section(section_type: type[T], values: Mapping[str, Any], *, where: str, name: str) -> T:
    """Validate `values` (raw YAML values or override strings) into a `section_type` instance.

    Args:
        section_type: a dataclass whose fields carry ``metadata={"help": ...}``.
        values: key -> value; ``None`` (or 'null'/'none') sets an optional field to None.
        where: the file or 'command line', for error messages.
        name: the section name, for error messages.
    """
    fields = _field_types(section_type)
    argv: list[str] = []
    given: dict[str, list[str]] = {}
    nulls: list[str] = []
    empties: list[str] = []
    for key, value in values.items():
        if key not in fields:
            raise unknown_name("key", f"{name}.{key}", [f"{name}.{f}" for f in fields], where)
        if value is None or (isinstance(value, str) and value.lower() in _NULLS):
            if not _is_optional(fields[key]):
                raise ConfigError(f"{where}: {name}.{key} cannot be null")
            nulls.append(key)
            continue
        if isinstance(value, str) and _is_list(fields[key]):
            # 'a,b' or YAML-style '[a, b]' ('[]' = empty)
            text = value.strip()
            if text.startswith("[") and text.endswith("]"):
                text = text[1:-1]
            value = [item.strip() for item in text.split(",") if item.strip()]
        try:
            tokens = _as_argument(value)
        except ConfigError as error:
            raise ConfigError(f"{where}: {name}.{key}: {error}") from None
        if not tokens:
            if not _is_list(fields[key]):
                raise ConfigError(f"{where}: {name}.{key} has an empty value")
            empties.append(key)  # argparse cannot express an empty list; set it afterwards
            continue
        given[key] = tokens
        # `--key=value` keeps a value that looks like an option ('-inf', '--') a value.
        argv += [f"--{key}={tokens[0]}"] if len(tokens) == 1 else [f"--{key}", *tokens]
    parser = _section_parser(section_type, where, name)
    try:
        namespace, remaining = parser.parse_known_args(argv)
    except ConfigError:
        raise
    except Exception as error:  # argparse.ArgumentError and type conversion failures
        raise ConfigError(f"{where}: {_readable(str(error), name)}") from error
    if remaining:
        keys = [f"{name}.{key}" for key, tokens in given.items() if set(tokens) & set(remaining)]
        raise ConfigError(
            f"{where}: {', '.join(keys) or name}: could not use {remaining}; give one value per "
            "key (a list only where the key takes one)"
        )
    kwargs = {key: getattr(namespace, key) for key in fields}
    kwargs.update(dict.fromkeys(nulls))
    kwargs.update({key: [] for key in empties})
    for key, value in kwargs.items():
        # argparse's float() takes 'nan' and 'inf'; no hyper-parameter can be either.
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}: {name}.{key}={value} must be a finite number")
        # argparse drops a '--' value, leaving [] where one value was expected.
        if isinstance(value, list) and not _is_list(fields[key]):
            raise ConfigError(f"{where}: {name}.{key}: cannot read {given[key]} as one value")
    try:
        return section_type(**kwargs)
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from error


def _parse_overrides(overrides: Sequence[str]) -> dict[str, dict[str, str]]:
    """``["train.lr=3e-4"]`` -> ``{"train": {"lr": "3e-4"}}``."""
    nested: dict[str, dict[str, str]] = {}
    for override in overrides:
        key, sep, value = override.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not section or not name:
            raise ConfigError(
                f"command line: override {override!r} is not of the form section.key=value "
                "(e.g. train.lr=3e-4)"
            )
        nested.setdefault(section, {})[name] = value.strip()
    return nested


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping of sections, with errors naming the file and line."""
    path = Path(path)
    if "\0" in str(path):  # open() would fail with a ValueError that reads like bad YAML
        raise ConfigError(f"config path {str(path)!r} holds a NUL byte; pass the recipe's path")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError as error:
        raise ConfigError(f"config file {path} does not exist") from error
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: byte {error.start + 1} is not UTF-8; save the recipe as UTF-8 text"
        ) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        # ReaderError (a control character) has no `problem`, and its str() spans two lines.
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{path}{line}: invalid YAML ({problem})") from error
    except (ValueError, RecursionError) as error:  # e.g. a date such as 2001-13-01
        raise ConfigError(f"{path}: invalid YAML value ({error})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


def load_config(
    config_type: type[T],
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
) -> T:
    """Build `config_type` from an optional YAML file and ``section.key=value`` overrides.

    Overrides win over the file; both are validated by the same parser. Sections missing from
    both keep their defaults.

    Raises:
        ConfigError: naming the file (or 'command line'), the key and the fix.
    """
    sections = _section_types(config_type)
    from_file = read_yaml(path) if path is not None else {}
    from_cli = _parse_overrides(overrides)
    where_file = str(path) if path is not None else "config"
    for where, source in ((where_file, from_file), ("command line", from_cli)):
        for section, values in source.items():
            if section not in sections:
                raise unknown_name("section", str(section), list(sections), where)
            if not isinstance(values, Mapping):
                raise ConfigError(f"{where}: section {section!r} must be a mapping of keys")
    built: dict[str, Any] = {}
    for section, section_type in sections.items():
        values = {**from_file.get(section, {}), **from_cli.get(section, {})}
        where = where_file if section not in from_cli else f"{where_file} + command line"
        built[section] = parse_section(section_type, values, where=where, name=section)
    return config_type(**built)


def to_dict(config: DataclassInstance) -> dict[str, Any]:
    """A config as plain YAML-able data (for saving beside a run)."""
    return dataclasses.asdict(config)


def describe(config_type: type[Any]) -> str:
    """Every key of `config_type` with its type, default and help, for ``--help`` texts."""
    lines = []
    for section, section_type in _section_types(config_type).items():
        lines.append(f"{section}:")
        defaults = section_type()
        annotations = _field_types(section_type)
        for item in dataclasses.fields(section_type):
            default = getattr(defaults, item.name)
            annotation = annotations[item.name]
            type_name = getattr(annotation, "__name__", None) or str(annotation)
            if typing.get_origin(annotation) is Literal:
                type_name = "|".join(map(str, typing.get_args(annotation)))
            help_text = item.metadata.get("help", "")
            lines.append(f"  {section}.{item.name} ({type_name}, default {default!r}): {help_text}")
    return "\n".join(lines)
