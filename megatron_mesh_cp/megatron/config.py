"""Flat YAML launcher configs -> Megatron command-line flags, with strict environment substitution.

``name: value`` becomes ``--name value``; ``true`` -> ``--name``; ``null`` -> omitted; a list ->
``--name v1 v2 ...``. ``false`` -> omitted for a ``--name`` switch, and ``--no-name`` for a Megatron setting
that only a ``--no-...`` flag turns off (``create_attention_mask_in_dataloader: false`` ->
``--no-create-attention-mask-in-dataloader``); a ``false`` that matches neither is a :class:`ConfigError`,
never silently dropped; a key that is no Megatron or mesh-CP setting is one too, naming the file and the
nearest settings. ``include: OTHER.yaml`` (relative to the file) reads that config first; the
file's own keys then replace its values (``key: null`` removes one), so an A/B partner or a later
stage states only what differs. ``$VAR`` / ``${VAR}`` in strings are substituted by the standard library's
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
from typing import Dict, FrozenSet, List, Mapping, Optional, Tuple

__all__ = ["ConfigError", "config_to_argv", "load_config", "megatron_parser", "multi_value_flags"]


class ConfigError(ValueError):
    """A config file that cannot be turned into arguments as written (the message names the fix)."""


def megatron_parser() -> argparse.ArgumentParser:
    """Megatron's own argument parser with the mesh-CP arguments added (parses, validates nothing)."""
    from megatron.training.arguments import add_megatron_arguments

    from .arguments import add_mesh_args

    return add_mesh_args(add_megatron_arguments(argparse.ArgumentParser(add_help=False, allow_abbrev=False)))


@lru_cache(maxsize=1)
def _actions():
    """(option string -> action, dest -> actions) of Megatron's parser plus the mesh-CP arguments."""
    parser = megatron_parser()
    by_dest = {}
    for a in parser._actions:
        by_dest.setdefault(a.dest, []).append(a)
    return dict(parser._option_string_actions), by_dest


@lru_cache(maxsize=1)
def multi_value_flags() -> FrozenSet[str]:
    """Option strings that take several values in Megatron's parser plus the mesh-CP arguments."""
    return frozenset(s for a in megatron_parser()._actions
                     if a.nargs in ("*", "+") or (isinstance(a.nargs, int) and a.nargs > 1) for s in a.option_strings)


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
                   multi: Optional[FrozenSet[str]] = None) -> List[str]:
    """The Megatron flags a flat YAML config stands for (``env`` defaults to ``os.environ``)."""
    env = os.environ if env is None else env
    cfg, origin = _load(path)
    argv: List[str] = []
    errors: List[str] = []
    for key, value in cfg.items():
        try:
            argv += _flag_tokens(key, value, origin[key], env, multi)
        except ConfigError as exc:
            errors.append(str(exc))
    if errors:  # every problem at once, not one per attempt
        raise ConfigError("; ".join(errors))
    return argv


def load_config(path: str) -> Dict:
    """The config's keys in order, ``include`` resolved (the included file's keys first, this file's
    values replacing theirs)."""
    return _load(path)[0]


def _load(path: str, _seen: Tuple[str, ...] = ()) -> Tuple[Dict, Dict[str, str]]:
    """(keys in order, the file each key's value comes from)."""
    import yaml

    real = os.path.realpath(path)
    if real in _seen:
        raise ConfigError(f"{path}: include cycle: {' -> '.join(_seen + (real,))}")
    try:
        with open(path) as f:
            cfg = yaml.safe_load(f) or {}
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: expected a mapping of argument names to values")
    base = cfg.pop("include", None)
    here = {str(k): path for k in cfg}
    if base is None:
        return cfg, here
    if not isinstance(base, str):
        raise ConfigError(f"{path}: include: expected one file name, got {base!r}")
    merged, origin = _load(os.path.join(os.path.dirname(path), base), _seen + (real,))
    merged.update(cfg)
    origin.update(here)
    return merged, origin


def _flag(key: str, path: str) -> str:
    """The option string a config key stands for: ``--name-with-dashes``, or the flag of the Megatron setting named
    ``key`` when its spelling differs (``override_opt_param_scheduler`` -> ``--override-opt_param-scheduler``);
    an unknown key is a :class:`ConfigError` naming the key, the file and the nearest settings."""
    import difflib

    options, by_dest = _actions()
    flag = "--" + str(key).replace("_", "-")
    if flag in options:
        return flag
    for action in by_dest.get(str(key), []):
        if action.option_strings and not isinstance(action, argparse._StoreFalseAction):
            return action.option_strings[0]
    if str(key) in by_dest:
        return flag  # a setting only a --no-... flag turns off: _switch maps its false value
    names = sorted({d for d in by_dest if d and not d.startswith("_")})
    near = difflib.get_close_matches(str(key), names, n=3, cutoff=0.6)
    hint = (f"; did you mean {' or '.join(near)}?" if near
            else " (python scripts/pretrain_gpt_mesh.py --help lists them)")
    raise ConfigError(f"{path}: {key}: not a Megatron or mesh-CP setting (Megatron has no {flag}){hint}")


def _switch(key: str, flag: str, value: bool, path: str) -> List[str]:
    """A boolean value: the ``--name`` switch, or Megatron's ``--no-name`` flag for a setting that is on by default."""
    options, by_dest = _actions()
    if flag in options:
        return [flag] if value else []
    store_false = [a for a in by_dest.get(str(key), []) if isinstance(a, argparse._StoreFalseAction)]
    if store_false:
        return [] if value else [store_false[0].option_strings[0]]
    if value:
        return [flag]  # Megatron's parser rejects an unknown flag loudly
    raise ConfigError(f"{path}: {key}: false, but Megatron has no {flag} switch and no setting {key!r} that a "
                      "--no-... flag turns off; the value would be silently dropped (check the name)")


def _flag_tokens(key, value, path: str, env: Mapping[str, str], multi: Optional[FrozenSet[str]]) -> List[str]:
    if value is None:
        return []
    flag = _flag(key, path)
    if isinstance(value, bool):
        return _switch(key, flag, value, path)
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
