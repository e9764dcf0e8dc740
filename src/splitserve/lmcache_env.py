"""LMCache's configuration, read as splitserve settings: a resource or a pod written for vLLM + LMCache keeps
its ``LMCACHE_*`` variables, and those with a splitserve equivalent take effect.

:func:`translate` turns ``LMCACHE_*`` variables (and the YAML file ``LMCACHE_CONFIG_FILE`` names, whose keys
are the same names without the prefix, in lower case, as LMCache reads them; a variable beats the file) into
the ``SPLITSERVE_*`` variables ``splitserve worker`` reads, with LMCache's units converted:

=============================  ===================================  ==============================================
LMCache                        splitserve                           conversion
=============================  ===================================  ==============================================
``LMCACHE_CHUNK_SIZE``         ``--kv-chunk-size``                  tokens, as is
``LMCACHE_LOCAL_CPU``          ``--l1-cache``                       a boolean (LMCache's true/1/yes)
``LMCACHE_MAX_LOCAL_CPU_SIZE`` ``--l1-cache-bytes``                 GiB (a float) to bytes; turns L1 on unless
                                                                    ``LMCACHE_LOCAL_CPU`` is false
``LMCACHE_LOCAL_DISK``         ``--l2-backend tieredstorage``,      ``file:///path`` or a path
                               ``--l2-path``
``LMCACHE_MAX_LOCAL_DISK_SIZE`` ``--l2-max-bytes``                  GiB (a float) to bytes
``LMCACHE_REMOTE_URL``         ``--l2-backend redis``, ``--l2-url`` ``redis://`` or ``rediss://`` only; a remote
                                                                    L2 wins over a local disk (one L2 tier here)
``LMCACHE_SAVE_DECODE_CACHE``  ``--save-decode-cache``              read by the option itself
``LMCACHE_PD_BUFFER_SIZE``     ``--pd-buffer-size``                 bytes, as is
=============================  ===================================  ==============================================

A ``SPLITSERVE_*`` variable that is already set wins over its LMCache counterpart, and a command-line flag
over both. Every other ``LMCACHE_*`` variable (and file key) has no equivalent: each gets a warning naming it,
except ``LMCACHE_USE_EXPERIMENTAL`` and ``LMCACHE_CONFIG_FILE``, which need nothing here. A value that does
not parse is an error naming the variable. No torch, no I/O beyond reading the named file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from splitserve import envs
from splitserve.settings import parse_bool

PREFIX = "LMCACHE_"
CONFIG_FILE_ENV = envs.LMCACHE_CONFIG_FILE.name
NOTHING_TO_DO = frozenset({"LMCACHE_USE_EXPERIMENTAL", CONFIG_FILE_ENV})
READ_BY_THE_OPTION = frozenset({"LMCACHE_SAVE_DECODE_CACHE"})  # the --save-decode-cache option reads it itself
GIB = 1 << 30
REDIS_SCHEMES = ("redis", "rediss")


@dataclass
class Translation:
    """What the LMCache configuration amounts to: ``SPLITSERVE_*`` variables to set, and warnings to show."""

    settings: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def _flag(name: str, value: str) -> bool:
    try:
        return parse_bool(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a boolean (true or false)") from None


def _gib(name: str, value: str) -> int:
    try:
        size = float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a size in GiB (LMCache's unit), e.g. 5.0") from None
    if not size >= 0 or size == float("inf"):
        raise ValueError(f"{name}={value!r} must be a finite size of 0 GiB or more")
    return int(size * GIB)


def _count(name: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a whole number") from None
    if number <= 0:
        raise ValueError(f"{name}={value!r} must be positive")
    return number


def _chunk_size(name: str, value: str, out: Translation) -> None:
    out.settings["SPLITSERVE_KV_CHUNK_SIZE"] = str(_count(name, value))


def _local_cpu(name: str, value: str, out: Translation) -> None:
    out.settings["SPLITSERVE_L1_CACHE"] = str(_flag(name, value)).lower()


def _max_local_cpu_size(name: str, value: str, out: Translation) -> None:
    out.settings["SPLITSERVE_L1_CACHE_BYTES"] = str(_gib(name, value))
    out.settings.setdefault("SPLITSERVE_L1_CACHE", "true")  # LMCache's L1 is on unless LOCAL_CPU says otherwise


def _local_disk(name: str, value: str, out: Translation) -> None:
    path = value.strip().removeprefix("file://")
    if not path:
        raise ValueError(f"{name} names no directory")
    if out.settings.get("SPLITSERVE_L2_BACKEND") == "redis":
        out.warnings.append(f"{name} is ignored: LMCACHE_REMOTE_URL gives the L2 tier (splitserve has one)")
        return
    out.settings |= {"SPLITSERVE_L2_BACKEND": "tieredstorage", "SPLITSERVE_L2_PATH": path}


def _max_local_disk_size(name: str, value: str, out: Translation) -> None:
    out.settings["SPLITSERVE_L2_MAX_BYTES"] = str(_gib(name, value))


def _remote_url(name: str, value: str, out: Translation) -> None:
    scheme = urlsplit(value.strip()).scheme
    if scheme not in REDIS_SCHEMES:
        out.warnings.append(f"{name} is ignored: only redis:// and rediss:// remote tiers exist here, not {scheme}://")
        return
    if out.settings.get("SPLITSERVE_L2_BACKEND") == "tieredstorage":
        out.warnings.append("LMCACHE_LOCAL_DISK is ignored: LMCACHE_REMOTE_URL gives the L2 tier (splitserve has one)")
        out.settings.pop("SPLITSERVE_L2_PATH", None)
    out.settings |= {"SPLITSERVE_L2_BACKEND": "redis", "SPLITSERVE_L2_URL": value.strip()}


def _pd_buffer_size(name: str, value: str, out: Translation) -> None:
    out.settings["SPLITSERVE_PD_BUFFER_SIZE"] = str(_count(name, value))


# In this order: LOCAL_CPU before MAX_LOCAL_CPU_SIZE (which only defaults L1 on), REMOTE_URL before LOCAL_DISK
# (the remote tier wins, whatever the order the variables came in).
MAPPED: dict[str, Callable[[str, str, Translation], None]] = {
    "LMCACHE_CHUNK_SIZE": _chunk_size,
    "LMCACHE_LOCAL_CPU": _local_cpu,
    "LMCACHE_MAX_LOCAL_CPU_SIZE": _max_local_cpu_size,
    "LMCACHE_REMOTE_URL": _remote_url,
    "LMCACHE_LOCAL_DISK": _local_disk,
    "LMCACHE_MAX_LOCAL_DISK_SIZE": _max_local_disk_size,
    "LMCACHE_PD_BUFFER_SIZE": _pd_buffer_size,
}


def lmcache_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """The LMCache configuration as ``LMCACHE_*`` variables: the config file's keys, then the environment's."""
    found: dict[str, str] = {}
    path = environ.get(CONFIG_FILE_ENV, "").strip()
    if path:
        found |= _file_variables(Path(path))
    found |= {name: value for name, value in environ.items() if name.startswith(PREFIX)}
    return found


def _file_variables(path: Path) -> dict[str, str]:
    try:
        document: Any = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"{CONFIG_FILE_ENV}: cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{CONFIG_FILE_ENV}: {path} is not YAML: {exc}") from None
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ValueError(f"{CONFIG_FILE_ENV}: {path} must hold a mapping of LMCache settings")
    return {PREFIX + str(key).upper(): _text(value) for key, value in document.items() if value is not None}


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def translate(environ: Mapping[str, str]) -> Translation:
    """The ``SPLITSERVE_*`` settings and warnings the LMCache configuration in ``environ`` amounts to.

    Raises ``ValueError`` naming the variable whose value does not parse."""
    variables = lmcache_variables(environ)
    out = Translation()
    for name, apply in MAPPED.items():
        if name in variables:
            apply(name, variables[name], out)
    for name in sorted(variables):
        if name not in MAPPED and name not in NOTHING_TO_DO and name not in READ_BY_THE_OPTION:
            out.warnings.append(f"{name} is ignored: splitserve has no equivalent")
    overridden = [key for key in out.settings if environ.get(key, "") != ""]
    for key in overridden:
        del out.settings[key]
    return out


def apply(environ: MutableMapping[str, str] | None = None) -> Translation:
    """Set the translated variables in ``environ`` (the process's, by default) where they are not set yet, and
    return what was set and the warnings to show. Call it before the worker's options are parsed."""
    environ = envs.live() if environ is None else environ
    translation = translate(environ)
    environ.update(translation.settings)
    return translation
