"""One frozen dataclass per stage; the CLI and the TOML config are generated from its fields.

A stage declares its settings once:

    @dataclass(frozen=True, kw_only=True)
    class ExtractConfig(StageConfig):
        store: str = opt("runs/demo/store", "output store folder")
        layers: tuple[int, ...] = opt((), "HF hidden_states indices of the three features; empty = [2, L//2, L-3]")

`add_arguments(parser, ExtractConfig)` makes `--store`, `--layers 2 15 27`; `from_namespace` builds the
dataclass back (running its `__post_init__` validation); `from_mapping` does the same for a TOML table.
Defaults live only in the dataclass, never in argparse.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from eyas.core.errors import EyasError
from eyas.core.files import read_toml


def opt(default: Any, help: str, *, positional: bool = False, choices: tuple | None = None,
        check: Callable[[Any], str | None] | None = None) -> Any:
    """A dataclass field with its CLI help. `positional=True` makes it a positional argument; `check(value)` says
    why a value is refused (None when it is fine), run by `StageConfig.__post_init__` (the shared options of
    `eyas.core.options` carry theirs)."""
    meta = {"help": help, "positional": positional, "choices": choices, "check": check}
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple default, dataclasses are frozen")
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageConfig:
    """Settings every stage has."""

    quiet: bool = opt(False, "print only errors and the final one-line summary")
    json: bool = opt(False, "print the stage's summary as one JSON object on stdout (implies --quiet)")

    def __post_init__(self):
        """Each field's own check (the shared options'), then the stage's `validate`."""
        for f in dataclasses.fields(self):
            if (field_check := f.metadata.get("check")) and (why := field_check(getattr(self, f.name))):
                raise EyasError(why, fix=f"see eyas COMMAND --help for {_flag(f.name)}")
        self.validate()

    def validate(self) -> None:
        """A stage's checks of its settings together (raise EyasError naming the value and the fix)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """(inner type, optional?) for `X | None`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


# Every spelling of a dtype, accepted by every command's --dtype; each command keeps its own spelling internally.
DTYPE_ALIASES = (("bf16", "bfloat16"), ("fp32", "float32", "float"), ("fp16", "float16", "half"))


def dtype_spelling(value: Any, choices: tuple[str, ...]) -> Any:
    """A dtype given in any spelling (bf16 / bfloat16, fp32 / float32, fp16 / float16, torch.bfloat16) -> the one
    among `choices`, a command's own; anything else is returned as it is, for the choices check to name."""
    if not isinstance(value, str):
        return value
    v = value.strip().lower().removeprefix("torch.")
    for group in DTYPE_ALIASES:
        if v in group:
            return next((c for c in choices if c in group), v)
    return v


def _choices(tp: Any, meta) -> tuple | None:
    if meta.get("choices"):
        return tuple(meta["choices"])
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one argument per dataclass field of `cls` to `parser`."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, _ = _unwrap(hints[f.name])
        meta = f.metadata
        default = f.default if f.default is not dataclasses.MISSING else None
        helptext = meta.get("help", "")
        shown = helptext if meta.get("positional") else f"{helptext} (default: {default!r})"
        kwargs: dict[str, Any] = {"help": shown}
        origin = typing.get_origin(tp)
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif origin in (tuple, list):
            inner = typing.get_args(tp)[0]
            kwargs.update(nargs="*", type=inner)
        elif origin is Literal:
            kwargs.update(choices=typing.get_args(tp), type=type(typing.get_args(tp)[0]))
        else:
            kwargs["type"] = tp if tp in (int, float, str) else str
        if meta.get("choices"):
            kwargs["choices"] = meta["choices"]
        if f.name == "dtype" and kwargs.get("choices"):  # any spelling, mapped to this command's
            kwargs["type"] = lambda s, c=tuple(kwargs["choices"]): dtype_spelling(s, c)
        if meta.get("positional"):
            if origin in (tuple, list):
                kwargs["nargs"] = "+" if default in ((), None) else "*"
            elif default is not None:
                kwargs["nargs"] = "?"
            parser.add_argument(f.name, default=argparse.SUPPRESS, **kwargs)
        else:
            parser.add_argument(_flag(f.name), dest=f.name, default=argparse.SUPPRESS, **kwargs)


def from_mapping(cls: type, values: dict, source: str = "arguments") -> Any:
    """Build `cls` from a dict (CLI namespace or TOML table); unknown keys are an error naming them."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k.replace("-", "_"): v for k, v in values.items()}
    unknown = sorted(set(values) - names)
    if unknown:
        raise EyasError(
            f"unknown setting(s) {', '.join(unknown)} in {source}",
            f"{cls.__name__} has no such field",
            f"use one of: {', '.join(sorted(names))}",
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    clean = {}
    for k, v in values.items():
        tp, optional = _unwrap(hints[k])
        if typing.get_origin(tp) in (tuple, list) and isinstance(v, list):
            v = tuple(v)
        choices = _choices(tp, fields[k].metadata)
        if k == "dtype" and choices:
            v = dtype_spelling(v, choices)
            if v not in choices:
                raise EyasError(f"dtype {values[k]!r} in {source} is not one eyas knows",
                                fix=f"use one of {', '.join(choices)} (or bf16/bfloat16, fp32/float32, fp16/float16)")
        if not (v is None and (optional or fields[k].default is None)):
            v = _typed(v, tp, choices, f"{source}: {k} = {values[k]!r}", k)
        clean[k] = v
    try:
        return cls(**clean)
    except TypeError as e:
        raise EyasError(f"bad settings in {source}: {e}", fix="check the names and types of the settings") from None


_KIND = {bool: ("true or false", "true"), int: ("a whole number", "8"), float: ("a number", "0.5"),
         str: ("a string", '"text"')}


def _typed(value: Any, tp: Any, choices: tuple | None, where: str, key: str) -> Any:
    """`value` as the field's type (an int is a float's value too), or an EyasError naming the key, where it was
    given, what it must be and an example: "four" for an int, 256.7 for an int, 1 for a bool are refused."""
    origin = typing.get_origin(tp)
    if choices is not None and origin in (tuple, list) and isinstance(value, (tuple, list)):
        bad = [x for x in value if x not in choices]  # a list option: each element is one of the choices
        if bad:
            raise EyasError(f"{where}: {', '.join(map(repr, bad))} not one of {', '.join(map(str, choices))}",
                            fix=f"write {key} = {json.dumps(list(choices[:1]))}")
        return tuple(value)
    if choices is not None:
        if value not in choices:
            raise EyasError(f"{where}: not one of {', '.join(map(str, choices))}",
                            fix=f"write {key} = {json.dumps(choices[0])}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (tuple, list)):
            raise EyasError(f"{where}: a list is expected", fix=f"write {key} = [...]")
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        inner = args[0] if args else Any
        return tuple(_typed(x, inner, _choices(inner, {}), f"{where}, element {x!r}", key) for x in value)
    if tp not in _KIND:
        return value
    what, example = _KIND[tp]
    ok = (isinstance(value, bool) if tp is bool else isinstance(value, tp) and not isinstance(value, bool)
          or (tp is float and isinstance(value, int) and not isinstance(value, bool)))
    if not ok:
        raise EyasError(f"{where}: a value of type {type(value).__name__}, not {what}",
                        fix=f"write {key} = {example}")
    return float(value) if tp is float else value


def from_namespace(cls: type, ns: argparse.Namespace) -> Any:
    return from_mapping(cls, {k: v for k, v in vars(ns).items() if not k.startswith("_")})


def parse(cls: type, argv: list[str] | None = None, description: str | None = None) -> Any:
    """`cls` from a command line (sys.argv[1:] when argv is None): the stages' dataclass-to-CLI for a script outside
    the `eyas` command (bench/, examples/). A value `cls` refuses exits as argparse's own errors do: usage, reason."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, cls)
    try:
        return from_namespace(cls, parser.parse_args(argv))
    except EyasError as e:
        parser.error(str(e))


def load_toml(path: str | Path) -> dict:
    """Read a TOML config file; errors name the file and line."""
    return read_toml(path, fix="give the path of an existing .toml file")


def changed_settings(before: dict, now: dict, ignore=()) -> list[str]:
    """The keys (sorted) whose values differ between two recorded settings, a key missing on one side included:
    what stops a resume (train, extract, regenerate) from continuing under other settings."""
    return sorted(k for k in set(before) | set(now) if k not in ignore and before.get(k) != now.get(k))


def check(condition: bool, what: str, fix: str) -> None:
    """Validation helper for __post_init__: raise an EyasError naming the value and the fix."""
    if not condition:
        raise EyasError(what, fix=fix)


def to_argv(cfg: Any, only_changed: bool = True) -> list[str]:
    """The command-line arguments that rebuild `cfg` (used to launch a stage under torchrun)."""
    argv: list[str] = []
    positional: list[str] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if only_changed and f.default is not dataclasses.MISSING and value == f.default:
            continue
        if f.metadata.get("positional"):
            positional += [str(v) for v in value] if isinstance(value, (tuple, list)) else [str(value)]
        elif isinstance(value, bool):
            argv.append(_flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, (tuple, list)):
            argv += [_flag(f.name), *map(str, value)]
        elif value is not None:
            argv += [_flag(f.name), str(value)]
    return positional + argv
