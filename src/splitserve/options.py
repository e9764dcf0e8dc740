"""Typer options made from the settings' declarations (``splitserve.settings``), so a command's flags, help,
defaults and environment variables are never written out by hand.

:func:`settings_command` turns ``body(values)`` into a function whose signature has one keyword parameter per
setting, ``Annotated`` with its ``typer.Option``; typer reads that signature as it would a hand-written one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import typer

from splitserve.settings import Declared, Section, declared_in


def option_parameter(item: Declared) -> inspect.Parameter:
    """The keyword parameter that makes ``item``'s typer option."""
    names = [f"{item.option}/--no-{item.flag}"] if item.is_bool and item.setting.negatable else [item.option]
    if item.setting.short:
        names.append(f"-{item.setting.short}")
    option = typer.Option(
        *names,
        help=item.setting.help,
        envvar=list(item.env_names) or None,
        rich_help_panel=item.panel or None,
        show_default=item.setting.show_default,
    )
    return inspect.Parameter(
        item.parameter,
        inspect.Parameter.KEYWORD_ONLY,
        default=item.option_default,
        annotation=Annotated[item.option_type, option],
    )


def settings_command(sections: Sequence[Section]) -> Callable[[Callable[[dict[str, Any]], None]], Callable[..., None]]:
    """A decorator: ``body(values)`` as a typer command taking every setting of ``sections`` as an option.

    ``values`` maps each setting's parameter (its flag with underscores) to the option's parsed value.
    """
    items = declared_in(sections)
    parameters = [option_parameter(item) for item in items]
    names = [p.name for p in parameters]
    if len(set(names)) != len(names):
        raise TypeError(f"two settings share a flag: {sorted({n for n in names if names.count(n) > 1})}")

    def wrap(body: Callable[[dict[str, Any]], None]) -> Callable[..., None]:
        def command(**values: Any) -> None:
            body(values)

        command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in parameters}
        command.__doc__ = body.__doc__
        command.__name__ = body.__name__
        command.__qualname__ = body.__qualname__
        return command

    return wrap
