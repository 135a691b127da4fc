"""How the models of an array are built and traced, declared once for ``onnxfuse export``'s flags, a run config's
``model`` section and a sweep spec's: the factory (``MODULE:FACTORY``), its keyword arguments (``--args`` /
``model.args``) and the example inputs the export traces with (``--input-shape`` / ``--input-dtype``,
``model.input_shape`` / ``model.input_dtype``). Each is checked here, in one place, whichever way it is given;
``torch_export.py`` builds and exports from the checked values. No torch here: a config or a spec is checked
without it.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import keyword
import os
import re
import sys
from typing import Any, Callable, Mapping, Sequence

from onnxfuse.core.errors import ConfigError, OnnxFuseError

__all__ = ["load_factory", "call_factory", "factory_name", "factory_args", "check_factory_args", "model_inputs",
           "inputs_from_flags", "INPUT_DTYPES", "DEFAULT_INPUT", "DEFAULT_OPSET"]

# The TorchScript exporter keeps BatchNorm's training outputs; the dynamo exporter (torch >= 2.9 default) folded
# BatchNorm into the preceding Conv even in train mode, which makes the graph untrainable as exported.
DEFAULT_OPSET = 17

# the dtypes an example input may have (torch's names); floats are traced with random normal values, integers
# with zeros (a valid index of any embedding table), bools with True
INPUT_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
DEFAULT_DTYPE = "float32"
DEFAULT_INPUT = "input"  # the graph input's name when the model takes one input and none is given


def load_factory(spec: str) -> Callable:
    """Resolve ``MODULE:FACTORY`` (a dotted module importable from the current folder, or a .py file path): a Python
    function or class. Whatever goes wrong (no such file or module, a module that fails to import, a SyntaxError,
    a name that is not a function or class) is one ConfigError naming the factory."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(f"'{spec}' is not MODULE:FACTORY (e.g. onnxfuse.exporters.zoo:LeNet or my_models.py:make)")
    mod_name, _, attr = spec.rpartition(":")
    if not mod_name.strip() or not attr.strip():
        raise ConfigError(f"'{spec}' is not MODULE:FACTORY: give both a module (or .py file) and a name, e.g. "
                          "my_models.py:make")
    try:
        if mod_name.endswith(".py"):
            if not os.path.exists(mod_name):
                raise ConfigError(f"model file '{mod_name}' does not exist")
            s = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(mod_name))[0], mod_name)
            module = importlib.util.module_from_spec(s)
            s.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(mod_name)
    except ConfigError:
        raise
    except SyntaxError as e:  # the file's own line, not this frame's
        raise ConfigError(f"'{e.filename or mod_name}' (of {spec}) has a syntax error at line {e.lineno}: {e.msg}; "
                          "fix the file") from e
    except ImportError as e:
        raise ConfigError(f"cannot import '{mod_name}' (of {spec}: {e}); run from the folder that holds it or give "
                          "a .py path") from e
    except Exception as e:  # the module's own code failed while it was imported
        raise ConfigError(f"importing '{mod_name}' (of {spec}) raised {_exception_line(e)}; fix the module "
                          "(--verbose shows the traceback)") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"'{mod_name}' has no callable '{attr}'" + (
            f" ('{attr}' is {type(factory).__name__})" if hasattr(module, attr) else "")
            + "; give a function or class that builds the model")
    if inspect.isbuiltin(factory):  # os:system, print: C functions that build no model
        raise ConfigError(f"'{spec}' is a built-in function, not a model factory; give a Python function "
                          "or class that builds the model (e.g. my_models.py:make)")
    return factory


def factory_name(factory: Callable) -> str:
    """``MODULE:NAME`` of a factory, as ``load_factory`` takes it (its own repr when it has no such name)."""
    qualname, module = getattr(factory, "__qualname__", None), getattr(factory, "__module__", None)
    return f"{module}:{qualname}" if qualname and module else repr(factory)


def _exception_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _mismatched_args(factory: Callable, args: Mapping) -> list[str]:
    """The arguments given as text where the factory's default (or annotation) is a number or a bool: the likely
    cause when the call fails (``hidden=abc`` for ``hidden: int = 64``)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return []
    out = []
    for key, value in args.items():
        p = params.get(key)
        if p is None or not isinstance(value, str):
            continue
        if isinstance(p.default, (int, float)):  # bool is an int
            out.append(f"{key}={value!r} is text where its default is {p.default!r} ({type(p.default).__name__})")
        elif p.annotation in (int, float, bool, "int", "float", "bool"):
            annotation = getattr(p.annotation, "__name__", p.annotation)
            out.append(f"{key}={value!r} is text where it is annotated {annotation}")
    return out


def call_factory(factory: str | Callable, args: Mapping[str, Any] | None = None, name: str | None = None,
                 where: str = "") -> Any:
    """``factory(**args)``, ``factory`` a callable or ``MODULE:FACTORY`` (:func:`load_factory`): the arguments
    checked against its signature first (:func:`check_factory_args`), and whatever the call raises one ConfigError
    naming the factory and its arguments (the factory's own exception chained, for ``--verbose``)."""
    if isinstance(factory, str):
        name, factory = name or factory, load_factory(factory)
    args = dict(args or {})
    name = name or factory_name(factory)
    check_factory_args(factory, args, name, where)
    try:
        return factory(**args)
    except OnnxFuseError:
        raise
    except Exception as e:
        given = ", ".join(f"{k}={v!r}" for k, v in args.items())
        hint = "; ".join(_mismatched_args(factory, args))
        raise ConfigError(f"{where}the factory {name}({given}) raised {_exception_line(e)}; "
                          + (f"{hint}: give a value of that type (factory_args=, model.args)" if hint else
                             "fix the factory or its arguments (factory_args=, model.args); --verbose shows the traceback")
                          ) from e


# ------------------------------------------------------------------------------------------ factory arguments
# YAML 1.1 (PyYAML) reads 1e-3 (no dot) as a string; YAML 1.2 and Python read it as a number
_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _number_text(v: Any) -> Any:
    return float(v) if isinstance(v, str) and _EXPONENT.fullmatch(v.strip()) else v


def _yaml_value(text: str, key: str, name: str, where: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        problem = " ".join(str(e).split())[:120]
        raise ConfigError(f"{where}{key}: the value of {name}, {text!r}, does not parse as YAML ({problem}); quote it "
                          "if it is text") from None


def split_pairs(text: str) -> list[str]:
    """``KEY=VALUE`` pairs however they are separated: ``width=8,p=0.1``, ``width=8 p=0.1``, ``width=8, p=0.1``.
    A comma or a space separates two pairs only outside brackets and quotes and where a ``KEY=`` follows, so a value
    keeps its own commas: ``sizes=[16, 32],p=0.1`` is ``sizes=[16, 32]`` and ``p=0.1``; ``names=a,b`` is one pair."""
    pairs, start, depth, quote = [], 0, 0, ""
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"" and text[:i].rstrip()[-1:] in ("=", "[", "{", "(", ",", ":"):  # a YAML quoted scalar
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth = max(depth - 1, 0)
        elif (ch == "," or ch.isspace()) and depth == 0 and _NEXT_KEY.match(text, i + 1):
            pairs.append(text[start:i])
            start = i + 1
    pairs.append(text[start:])
    return [p.strip(", \t\n") for p in pairs if p.strip(", \t\n")]


_NEXT_KEY = re.compile(r"[\s,]*[A-Za-z_][A-Za-z0-9_]*\s*=")


def factory_args(raw: Mapping | Sequence[str] | None, key: str = "model.args", where: str = "") -> dict:
    """The factory's keyword arguments, checked: a mapping (a config file's or a sweep spec's ``model.args``) or
    ``KEY=VALUE`` texts (``--args``), each value read as YAML (``16`` an int, ``0.1`` a float, ``true`` a bool,
    ``[16, 32]`` a list, anything else the text); ``1e-3`` is a number either way. Bad input is one ConfigError
    line, begun by ``where`` and naming ``key``."""
    if raw is None:
        return {}
    if isinstance(raw, Mapping):
        items = list(raw.items())
    elif isinstance(raw, (list, tuple)) and all(isinstance(x, str) for x in raw):
        items = []
        for item in (pair for text in raw for pair in split_pairs(text)):
            name, sep, text = item.partition("=")
            if not sep or not name.strip():
                raise ConfigError(f"{where}{key}: '{item}' is not KEY=VALUE; give e.g. vocab_size=128")
            items.append((name.strip(), _yaml_value(text, key, name.strip(), where)))
    else:
        raise ConfigError(f"{where}{key} must be a mapping of the factory's keyword arguments (name: value), got "
                          f"{raw!r}")
    out: dict[str, Any] = {}
    for name, value in items:
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            raise ConfigError(f"{where}{key}: {name!r} is not a keyword argument's name (a Python identifier)")
        if name in out:
            raise ConfigError(f"{where}{key}: '{name}' is given twice; give it once")
        out[name] = _number_text(value)
    return out


def check_factory_args(factory: Callable, args: Mapping, name: str, where: str = "") -> None:
    """``factory`` takes every keyword of ``args`` and is given every argument it requires (checked against its
    signature before it is called, so that an error inside the factory stays the factory's own)."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: let the call say
        return
    takes = [p.name for p in signature.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    try:
        signature.bind_partial(**args)
    except TypeError:
        unknown = [k for k in args if k not in takes]
        takes_text = ", ".join(takes) or "no keyword arguments"
        raise ConfigError(f"{where}{name} takes no argument '{(unknown or list(args))[0]}' (factory_args=, model.args or "
                          f"a search key model.<name>); it takes: {takes_text}") from None
    missing = [p.name for p in signature.parameters.values()
               if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in args]
    if missing:
        raise ConfigError(f"{where}{name} requires the argument '{missing[0]}', which is not given; give it as "
                          f"factory_args={{{missing[0]!r}: VALUE}} (model.args in a config or sweep spec)")


# ------------------------------------------------------------------------------------------ example inputs
def _shape(v: Any, key: str, where: str) -> list[int]:
    if (not isinstance(v, (list, tuple)) or not v
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in v)):
        raise ConfigError(f"{where}{key}: {v!r} is not a list of positive integers like [32, 1, 28, 28] (batch "
                          "axis first)")
    return list(v)


def model_inputs(shape: Any, dtype: Any = None, where: str = "", key: str = "model.input_shape",
                 dtype_key: str = "model.input_dtype") -> tuple[dict[str, list[int]], dict[str, str]]:
    """The example inputs the export traces with, checked: ``({name: shape}, {name: dtype})`` in the forward's
    argument order. ``shape``: one shape (the graph input ``input``), or ``{name: shape}`` for a model with several
    inputs (the graph inputs' names, in the forward's order); ``dtype``: None (float32), one dtype for every input,
    or ``{name: dtype}`` (an input left out is float32)."""
    if isinstance(shape, Mapping):
        if not shape:
            raise ConfigError(f"{where}{key} is an empty mapping; give each input's shape by name")
        shapes = {}
        for name, s in shape.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{where}{key}: {name!r} is not an input name")
            shapes[name] = _shape(s, f"{key}.{name}", where)
    else:
        shapes = {DEFAULT_INPUT: _shape(shape, key, where)}

    def one(v: Any, k: str) -> str:
        if v not in INPUT_DTYPES:
            raise ConfigError(f"{where}{k}: {v!r} is not a dtype; give one of: {', '.join(INPUT_DTYPES)}")
        return v
    if dtype is None or isinstance(dtype, str):
        dtypes = {n: one(dtype or DEFAULT_DTYPE, dtype_key) for n in shapes}
    elif isinstance(dtype, Mapping):
        unknown = [n for n in dtype if n not in shapes]
        if unknown:
            raise ConfigError(f"{where}{dtype_key}: '{unknown[0]}' is not an input; the inputs are: "
                              f"{', '.join(shapes)} (named by {key})")
        dtypes = {n: one(dtype.get(n, DEFAULT_DTYPE), f"{dtype_key}.{n}") for n in shapes}
    else:
        raise ConfigError(f"{where}{dtype_key}: {dtype!r} is not a dtype (e.g. int64), or one per input by name")
    return shapes, dtypes


def inputs_from_flags(shapes: Sequence[str], dtype: str | None) -> tuple[Any, Any]:
    """``--input-shape`` (once per input: ``D,D,...``, or ``NAME=D,D,...`` when the model takes several) and
    ``--input-dtype`` (``DTYPE``, or ``NAME=DTYPE,...``) as the values a config file gives (:func:`model_inputs`
    checks them)."""
    named: dict[str, Any] = {}
    unnamed = []
    for text in shapes:
        name, sep, dims = text.rpartition("=") if "=" in text else ("", "", text)
        try:
            shape = [int(d) for d in dims.split(",") if d.strip()]
        except ValueError:
            shape = []
        if not shape or any(d < 1 for d in shape) or (sep and not name.strip()):
            raise ConfigError(f"input_shape: '{text}' is not [NAME=]D,D,... of positive integers, e.g. 32,3,32,32 "
                              "or input_ids=8,16")
        if not sep:
            unnamed.append(shape)
        elif name.strip() in named:
            raise ConfigError(f"input_shape: input '{name.strip()}' is given twice; give each input once")
        else:
            named[name.strip()] = shape
    if unnamed and (named or len(unnamed) > 1):
        raise ConfigError("input_shape: a model with several inputs needs each named, in the forward's order, "
                          "e.g. input_ids=8,16 and mask=8,16")
    raw_shape = unnamed[0] if unnamed else named
    if dtype is None or "=" not in dtype:
        return raw_shape, dtype
    raw_dtype = {}
    for item in dtype.split(","):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"input_dtype: '{dtype}' is not DTYPE or NAME=DTYPE,... (e.g. int64, or "
                              "input_ids=int64,mask=bool)")
        raw_dtype[name.strip()] = value.strip()
    return raw_shape, raw_dtype
