"""Settings declared once, at the config field they set.

A :class:`Setting` is a config field's outside face: its help, its flag's spelling, its environment variable and
what a resource file may do with it. It rides in the field's metadata (:func:`setting`), so the field, its
default and its documentation are one line of ``splitserve.config``. Everything else is derived from there:

- the typer options of ``splitserve worker`` and ``splitserve router`` (``splitserve.cli``),
- which flags a resource's ``args`` may carry, with what type, and why the others are refused
  (``splitserve.deploy.plan``),
- the environment variables (``splitserve.envs``) and the reference in ``docs/configuration.md``.

No typer, no torch: the planner and the deploy tools read the declarations too.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

SETTING = "splitserve.setting"  # the key of a field's metadata that holds its Setting
AS_FIELD: Any = type("AsField", (), {"__repr__": lambda self: "AS_FIELD"})()  # an option default: the field's
REQUIRED: Any = type("Required", (), {"__repr__": lambda self: "REQUIRED"})()  # a setting without a default
ENV_PREFIX = "SPLITSERVE_"


class Use(enum.StrEnum):
    """What a resource file's ``args`` may do with a worker flag."""

    ARGS = "args"  # spec.worker.args (and a PD role's args) may set it
    RESOURCE = "resource"  # a resource field sets it: in args it is an error naming the field
    INSTANCE = "instance"  # the supervisor or operator sets it per worker: an error in args
    PLANNED = "planned"  # the plan sets it for every worker (the model, the bound address): dropped from args
    REFUSED = "refused"  # never from args, for the reason given


@dataclass(frozen=True, slots=True)
class Setting:
    """How a config field is set from outside the process."""

    help: str
    flag: str = ""  # the flag without its dashes; "": the field's name, "_" written "-"
    short: str = ""  # a one-letter alias ("f" for -f), if any
    env: bool = False  # also read from SPLITSERVE_<FLAG> (dashes as "_") when the flag is absent
    env_aliases: tuple[str, ...] = ()  # more variables read after that one (LMCache's, vLLM's)
    panel: str = ""  # the --help section; "": its config class's
    use: Use = Use.ARGS
    why: str = ""  # RESOURCE: the resource field that sets it; REFUSED: the reason
    convert: Callable[[Any], Any] | None = None  # the option's value to the field's (parse_bytes); None: as is
    option_type: Any = None  # the option's type when it is not the field's (a size written "1GiB": str)
    option_default: Any = AS_FIELD  # the option's default when it is not the field's
    negatable: bool = True  # a boolean option has a --no- form
    show_default: bool = True


def setting(default: Any, help: str, *, secret: bool = False, **how: Any) -> Any:
    """A dataclass field with ``default`` whose outside face is ``Setting(help, **how)``; a ``secret`` one is left
    out of the config's repr (so out of logs). A ``REQUIRED`` one has no default (the option must be given)."""
    metadata = {SETTING: Setting(help, **how)}
    if default is REQUIRED:
        return dataclasses.field(repr=not secret, metadata=metadata)
    return dataclasses.field(default=default, repr=not secret, metadata=metadata)


@dataclass(frozen=True, slots=True)
class Section:
    """A config class whose settings a command takes, under one --help heading."""

    config: type
    panel: str = ""
    skip: frozenset[str] = frozenset()  # fields whose settings this command does not take


@dataclass(frozen=True, slots=True)
class Declared:
    """One setting where it is declared: its config class, field, types and default."""

    config: type
    name: str  # the field
    field_type: Any  # the field's resolved type
    default: Any  # the field's default; REQUIRED when it has none
    setting: Setting
    panel: str

    @property
    def flag(self) -> str:
        return self.setting.flag or self.name.replace("_", "-")

    @property
    def option(self) -> str:
        """The flag as written: ``--max-num-seqs``."""
        return f"--{self.flag}"

    @property
    def parameter(self) -> str:
        """The command function's parameter: the flag with underscores (unique within a command)."""
        return self.flag.replace("-", "_")

    @property
    def env_names(self) -> tuple[str, ...]:
        own = (ENV_PREFIX + self.parameter.upper(),) if self.setting.env else ()
        return own + self.setting.env_aliases

    @property
    def option_type(self) -> Any:
        """The option's type: the declared one, else the field's, with a tuple given as a repeatable list."""
        if self.setting.option_type is not None:
            return self.setting.option_type
        if typing.get_origin(self.field_type) is tuple:
            item: Any = typing.get_args(self.field_type)[0]
            return list[item] | None
        return self.field_type

    @property
    def option_default(self) -> Any:
        if self.setting.option_default is not AS_FIELD:
            return self.setting.option_default
        if self.default is REQUIRED:
            return ...  # typer's mark of a required option
        return None if typing.get_origin(self.field_type) is tuple else self.default

    @property
    def kind(self) -> type:
        """The option's value type with ``| None`` and ``list[...]`` taken off: bool, int, float, str or an enum."""
        kind = self.option_type
        if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
            kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
        if typing.get_origin(kind) is list:
            kind = typing.get_args(kind)[0]
        return typing.cast(type, kind)

    @property
    def is_bool(self) -> bool:
        return self.kind is bool

    def to_field(self, value: Any) -> Any:
        """The option's parsed value as the field's: converted, and a repeated option as a tuple."""
        if self.setting.convert is not None:
            return self.setting.convert(value)
        if typing.get_origin(self.field_type) is tuple:
            return tuple(value or ())
        return value


def declared(config: type, panel: str = "") -> Iterator[Declared]:
    """The settings of a config dataclass, in field order."""
    hints = typing.get_type_hints(config)
    for field in dataclasses.fields(config):
        found = field.metadata.get(SETTING)
        if found is None:
            continue
        factory: Any = field.default_factory
        if field.default is not dataclasses.MISSING:
            default = field.default
        else:
            default = REQUIRED if factory is dataclasses.MISSING else factory()
        yield Declared(config, field.name, hints[field.name], default, found, found.panel or panel)


def declared_in(sections: Sequence[Section]) -> list[Declared]:
    """Every setting of a command, in the order of its sections."""
    return [
        item
        for section in sections
        for item in declared(section.config, section.panel)
        if item.name not in section.skip
    ]


def by_flag(sections: Sequence[Section]) -> dict[str, Declared]:
    """A command's settings by flag (``max-num-seqs``); a bare ``no-x`` names the boolean ``x``."""
    return {item.flag: item for item in declared_in(sections)}


TRUE_WORDS = ("1", "true", "yes", "y", "on")
FALSE_WORDS = ("0", "false", "no", "n", "off")


def parse_bool(text: str) -> bool:
    """``text`` as a boolean (``TRUE_WORDS``, ``FALSE_WORDS``, any case); ``ValueError`` for anything else."""
    word = text.strip().lower()
    if word not in TRUE_WORDS + FALSE_WORDS:
        raise ValueError(f"{text!r} is not a boolean")
    return word in TRUE_WORDS


def parse_text(item: Declared, text: str) -> Any:
    """The field value of ``item`` written as ``text`` (an environment variable's, say), parsed as its option
    would parse it; ``ValueError`` for text that does not parse."""
    kind: Any = item.kind
    value: Any
    if item.is_bool:
        value = parse_bool(text)
    elif kind in (int, float, str) or (isinstance(kind, type) and issubclass(kind, enum.Enum)):
        value = kind(text.strip())
    else:
        value = text
    return item.to_field(value)


def build(config: type, values: dict[str, Any], **derived: Any) -> Any:
    """An instance of ``config`` from a command's option values (keyed by parameter), converted to the fields'
    types, with ``derived`` fields set (or overridden) by the caller. A setting the command does not take keeps
    its default. A conversion's ``ValueError`` propagates, naming the flag."""
    kwargs = dict(derived)
    for item in declared(config):
        if item.name in derived or item.parameter not in values:
            continue
        try:
            kwargs[item.name] = item.to_field(values[item.parameter])
        except ValueError as exc:
            raise ValueError(str(exc) if item.option in str(exc) else f"{item.option}: {exc}") from None
    return config(**kwargs)
