"""The flags of ``onnxfuse train`` and ``check``: one per declared setting (``recipe/settings.py``: the run settings,
the registered optimizers' hyper-parameters, the loss options and the schedules' parameters), made from the
declaration when the parser is built (:func:`add_train_flags`), and read back as the config mapping a config file
is (:func:`flags_to_raw`), which ``recipe/train_config.py``'s ``run_config`` validates over ``--config``'s."""
from __future__ import annotations

import argparse
import os
from typing import Any

from onnxfuse.recipe.settings import (OPTIMIZERS, REQUIRED, SCHEDULES, Param, flag_of, flag_params, hyper_params,
                                      raw_key, set_dotted)

__all__ = ["add_train_flags", "flags_to_raw"]


def _dest(name: str) -> str:
    return "setting_" + name.replace(".", "__")


def _help(p: Param, what: str) -> str:
    said = p.help
    if p.per_model and p.kind.parse is not None and p.kind.metavar is None:
        said += "; one value, or one per model (comma-separated)"
    elif p.per_model and p.kind.parse is None:
        said += " (per model: --config)"
    if what.startswith("schedule."):
        users = [s.name for s in SCHEDULES.values() if s.param(p.name) is not None]
        said = f"{'/'.join(users)}: {said}"
    elif what in hyper_params():
        users = [s.name for s in OPTIMIZERS.values() if s.param(p.name) is not None]
        if len(users) < len(OPTIMIZERS):
            said = f"{'/'.join(users)}: {said}"
        defaults = {s.name: s.param(p.name).default for s in OPTIMIZERS.values() if s.param(p.name) is not None}
        if len({repr(v) for v in defaults.values()}) > 1:
            return f"{said} (default: " + ", ".join(f"{k} {v}" for k, v in defaults.items()) + ")"
    if p.default is not None and p.default is not REQUIRED and p.kind.parse is not None:
        said += f" (default {p.default})"
    elif p.kind.parse is None and p.default is True:  # the flag is --no-<name>: it says the non-default
        said += " (on by default; this flag turns it off)"
    return said.replace("%", "%%")


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of every setting (``onnxfuse train`` / ``check``), read from the tables and registries now."""
    for p, flag, what in flag_params():
        dest, h = _dest(what), _help(p, what)
        if p.kind.parse is None:  # a switch: says the non-default
            if p.default is True:
                parser.add_argument("--no-" + flag[2:], dest=dest, action="store_const", const=False, help=h)
            else:
                parser.add_argument(flag, dest=dest, action="store_const", const=True, help=h)
        elif p.kind.choices is not None:
            parser.add_argument(flag, dest=dest, choices=list(p.kind.choices()), help=h)
        elif p.per_model or p.kind.metavar:
            parser.add_argument(flag, dest=dest, metavar=p.kind.metavar or "V[,V...]", help=h)
        else:
            metavar = {int: "N", float: "X"}.get(p.kind.parse, p.name.upper())
            parser.add_argument(flag, dest=dest, type=p.kind.parse, metavar=metavar, help=h)
    parser.add_argument("--schedule", dest=_dest("schedule"), choices=list(SCHEDULES),
                        help="learning-rate schedule (torch.optim.lr_scheduler): " + ", ".join(
                            f"{s.name}{' (' + s.help + ')' if s.help else ''}" for s in SCHEDULES.values()))


def _flag_value(p: Param, text: str) -> Any:
    """A flag's text as a config file would give the value: per-model numbers comma-separated (one value, or one
    per model), a pair or a list of steps ``a,b``. What is not a number stays the text it is (an empty value
    ``''`` too), for the validation to name it as it names a file's."""
    def one(piece: str) -> Any:
        try:
            return p.kind.parse(piece)
        except ValueError:
            return piece
    if p.per_model and p.kind.metavar is None:  # a pair (betas) is one value, written a,b
        values = [one(v.strip()) for v in str(text).split(",")]
        return values[0] if len(values) == 1 else values
    try:
        return p.kind.parse(text)
    except ValueError:
        return [v.strip() for v in str(text).split(",")]


def flags_to_raw(args: argparse.Namespace) -> tuple[dict, dict[str, str]]:
    """The settings given as flags (only those: they override a config file, or a resumed run's own settings) as
    a config mapping, the shape of a config file (``{"optimizer": {"name": "adam", "lr": [0.1, 0.01]},
    "schedule": {...}, "data": {"train": ...}, "batch_size": 16, ...}``), and the flag that gave each dotted key
    (for messages). ``--data`` and ``--eval-data`` are the command's own flags (``cli/main.py``)."""
    raw: dict[str, Any] = {}
    named: dict[str, str] = {}
    for p, flag, what in flag_params():
        v = getattr(args, _dest(what), None)
        if v is None:
            continue
        if isinstance(v, str) and p.kind.choices is None and p.kind.parse is not None and \
                (p.per_model or p.kind.metavar):
            v = _flag_value(p, v)
        key = raw_key(what)
        set_dotted(raw, key, v)
        named[key] = flag_of(what)
    name = getattr(args, _dest("schedule"), None)
    if name:
        raw["schedule"] = {"name": name, **raw.get("schedule", {})}
        named["schedule.name"] = "--schedule"
    for key, flag, path in (("train", "--data", getattr(args, "data", None)),  # the data flags of the CLI's own
                            ("eval", "--eval-data", getattr(args, "eval_data", None))):
        if path is not None:
            set_dotted(raw, f"data.{key}", os.fspath(path))
            named[f"data.{key}"] = flag
    return raw, named
