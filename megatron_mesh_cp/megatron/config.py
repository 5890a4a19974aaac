"""Flat YAML launcher configs -> Megatron command-line flags, with strict environment substitution.

``name: value`` becomes ``--name value``; ``true`` -> ``--name``; ``null`` -> omitted; a list
-> ``--name v1 v2 ...``; ``false`` -> omitted where Megatron's default is already off, the negating flag
where Megatron has one (``create_attention_mask_in_dataloader: false`` ->
``--no-create-attention-mask-in-dataloader``), else a :class:`ConfigError` (never a silent default). ``$VAR`` / ``${VAR}`` in strings are substituted by the standard library's
``string.Template.substitute``: an unset variable is a :class:`ConfigError` naming the variable and
the key, never a literal ``${VAR}`` or an empty string (``$$`` is a literal ``$``). A string for a
flag that takes several values in Megatron's own parser (``nargs='*'``/``'+'``, e.g. ``data_path``
with a blend ``"0.3 /a 0.7 /b"``) is split into tokens like a shell would; any other value stays one
argument, spaces included.
"""

from __future__ import annotations

import argparse
import os
import shlex
from functools import lru_cache
from string import Template
from typing import FrozenSet, List, Mapping, Optional

__all__ = ["ConfigError", "config_to_argv", "megatron_parser", "multi_value_flags"]


class ConfigError(ValueError):
    """A config file that cannot be turned into arguments as written (the message names the fix)."""


def megatron_parser() -> argparse.ArgumentParser:
    """Megatron's own argument parser with the mesh-CP arguments added (parses, validates nothing)."""
    from megatron.training.arguments import add_megatron_arguments

    from .arguments import add_mesh_args

    return add_mesh_args(add_megatron_arguments(argparse.ArgumentParser(add_help=False, allow_abbrev=False)))


@lru_cache(maxsize=1)
def multi_value_flags() -> FrozenSet[str]:
    """Option strings that take several values in Megatron's parser plus the mesh-CP arguments."""
    return frozenset(s for a in megatron_parser()._actions
                     if a.nargs in ("*", "+") or (isinstance(a.nargs, int) and a.nargs > 1) for s in a.option_strings)


@lru_cache(maxsize=1)
def _switches() -> Mapping[str, tuple]:
    """dest -> (default, the option string that turns it off or None) for Megatron's and our switches."""
    out = {}
    for a in megatron_parser()._actions:
        if isinstance(a, argparse._StoreFalseAction):
            out[a.dest] = (True, a.option_strings[0])
        elif a.dest not in out:
            out[a.dest] = (a.default, None)
    return out


def _false_tokens(key: str, path: str, switches: Optional[Mapping[str, tuple]]) -> List[str]:
    """``key: false``: nothing where the switch is off by default, its negating flag where there is one."""
    default, off = (switches if switches is not None else _switches()).get(str(key), (None, None))
    if off is not None:
        return [off]
    if not default:
        return []
    raise ConfigError(f"{path}: {key}: false cannot be passed to Megatron (its default is {default!r} and it has "
                      f"no flag turning it off); drop the key or give a value")


def _substitute(value: str, key: str, path: str, env: Mapping[str, str]) -> str:
    try:
        return Template(value).substitute(env)
    except KeyError as exc:
        name = exc.args[0]
        raise ConfigError(f"{path}: {key}: environment variable {name} is not set (export {name}=... "
                          f"before launching, or write the value into the config)") from None
    except ValueError as exc:
        raise ConfigError(f"{path}: {key}: {exc} in {value!r} (write $$ for a literal $)") from None


def config_to_argv(path: str, env: Optional[Mapping[str, str]] = None,
                   multi: Optional[FrozenSet[str]] = None, switches: Optional[Mapping[str, tuple]] = None) -> List[str]:
    """The Megatron flags a flat YAML config stands for (``env`` defaults to ``os.environ``;
    ``multi`` / ``switches`` default to what Megatron's parser says)."""
    import yaml

    env = os.environ if env is None else env
    with open(path) as f:
        cfg = yaml.safe_load(f) or {}
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: expected a mapping of argument names to values")
    argv: List[str] = []
    errors: List[str] = []
    for key, value in cfg.items():
        try:
            argv += _false_tokens(key, path, switches) if value is False else _flag_tokens(key, value, path, env, multi)
        except ConfigError as exc:
            errors.append(str(exc))
    if errors:  # every problem at once, not one per attempt
        raise ConfigError("; ".join(errors))
    return argv


def _flag_tokens(key, value, path: str, env: Mapping[str, str], multi: Optional[FrozenSet[str]]) -> List[str]:
    flag = "--" + str(key).replace("_", "-")
    if value is None:
        return []
    if value is True:
        return [flag]
    if isinstance(value, (list, tuple)):
        return [flag] + [_substitute(str(v), key, path, env) for v in value]
    if not isinstance(value, str):
        return [flag, str(value)]
    text = _substitute(value, key, path, env)
    if flag not in (multi_value_flags() if multi is None else multi):
        return [flag, text]
    tokens = shlex.split(text)
    if not tokens:
        raise ConfigError(f"{path}: {key}: {value!r} is empty after substitution")
    return [flag] + tokens
