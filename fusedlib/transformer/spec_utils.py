"""Module specs: a model's structure as data, built into modules by :func:`build_module`.

A :class:`ModuleSpec` names a module (a class, a function, or an import path) and the
arguments only the spec knows (``params``, ``submodules``); the parent module supplies the
rest (``config``, sizes, ``layer_number``) when it builds it. A layer spec is a tree of such
specs: swapping one class in one slot (a fused norm for a plain one) changes the model
without touching the layer's code.

Beyond Megatron-core: an import path that does not import raises (Megatron-core logs it and
builds ``None``), and an error raised while building names every module on the way down,
e.g. ``... [while building ColumnParallelLinear] [while building SelfAttention]``.

Source: Megatron-LM ``megatron/core/transformer/spec_utils.py``.
"""
from __future__ import annotations

import copy
import importlib
import types
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Tuple, Union

__all__ = ["ModuleSpec", "import_module", "get_module", "build_module", "check_submodules"]

#: What build_module returns as it is, uncalled: functions (Megatron-core: ``types.FunctionType``).
_FUNCTION_TYPES = (types.FunctionType, types.BuiltinFunctionType)


@dataclass
class ModuleSpec:
    """What to build, and with which arguments of its own.

    Attributes:
        module: a class (``FusedLayerNorm``), a function (``get_bias_dropout_add``: returned
            uncalled), or an import path ``("fusedlib.fusions.fused_layer_norm", "FusedNorm")``.
        params: keyword arguments passed to the class, e.g. ``{"attn_mask_type": AttnMaskType.causal}``.
        submodules: passed as ``submodules=`` when not None: the dataclass of the module's own
            slots (``SelfAttentionSubmodules(...)``).
        metainfo: free-form information for tools; never passed to the module.

    Calling a spec builds it: ``spec(*args, **kwargs)`` is ``build_module(spec, *args, **kwargs)``.

    Source: Megatron-LM ``megatron/core/transformer/spec_utils.py``.
    """

    module: Union[Tuple[str, str], type, Callable[..., Any]]
    params: dict = field(default_factory=dict)
    submodules: object = None
    metainfo: dict = field(default_factory=dict)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return build_module(self, *args, **kwargs)


def import_module(module_path: Tuple[str, str]) -> Any:
    """Import ``name`` from the module ``base_path``: ``import_module(("torch.nn", "LayerNorm"))``.

    Raises:
        ImportError: the module does not import, or has no such name (Megatron-core logs the
            error and returns None, which fails later without saying why).
        TypeError: ``module_path`` is not a pair of strings.

    Source: Megatron-LM ``megatron/core/transformer/spec_utils.py`` (``import_module``).
    """
    if not (isinstance(module_path, tuple) and len(module_path) == 2 and all(isinstance(p, str) for p in module_path)):
        raise TypeError(f"an import path must be a pair (module, name) of strings, got {module_path!r}")
    base_path, name = module_path
    module = importlib.import_module(base_path)
    try:
        return getattr(module, name)
    except AttributeError:
        raise ImportError(f"module {base_path!r} has no {name!r} (import path {module_path!r})") from None


def _resolve(spec_or_module: Union[ModuleSpec, type, Callable[..., Any]]) -> Any:
    """The class or function a spec names, imported if it is an import path."""
    target = spec_or_module.module if isinstance(spec_or_module, ModuleSpec) else spec_or_module
    if isinstance(target, (type,) + _FUNCTION_TYPES):
        return target
    if isinstance(target, tuple):
        found = import_module(target)
        if not isinstance(found, (type,) + _FUNCTION_TYPES):
            raise TypeError(f"a module spec's import path must name a class or a function, got {target!r}: "
                            f"{type(found).__name__} {found!r}")
        return found
    raise TypeError(f"a module spec must name a class, a function or an import path (module, name), "
                    f"got {type(target).__name__}: {target!r}")


def get_module(spec_or_module: Union[ModuleSpec, type, Callable[..., Any]], **additional_kwargs: Any) -> Any:
    """The class or function ``spec_or_module`` names, without building it.

    Raises:
        ImportError, TypeError: as :func:`build_module`.

    Source: Megatron-LM ``megatron/core/transformer/spec_utils.py`` (``get_module``).
    """
    return _resolve(spec_or_module)


def build_module(spec_or_module: Union[ModuleSpec, type, Callable[..., Any]], *args: Any, **kwargs: Any) -> Any:
    """Build what a spec names.

    * a function (given directly, or as a spec's ``module``): returned as it is, uncalled
      (a slot such as ``self_attn_bda`` holds a function selector, called at each forward);
    * a class, or an import path: instantiated as ``module(*args, **spec.params, **kwargs)``
      plus ``submodules=spec.submodules`` when the spec has submodules.

    Args:
        spec_or_module: a :class:`ModuleSpec`, a class or a function.
        *args, **kwargs: the parent's arguments (``config=...``, sizes, ``layer_number=...``).

    Returns:
        The built module, or the function.

    Raises:
        TypeError: the spec names neither a class, a function nor an import path (or the
            import path names something else), a spec's
            ``params`` is not a dict, or repeats one of the parent's keyword arguments.
        ImportError: an import path that does not import.
        Any error of the module's constructor, re-raised with the same type and
            ``[while building <Class>]`` appended, so a failure deep in a layer spec names
            the path down to the module that failed (an OSError keeps its errno and filename,
            the text in its strerror; an error whose type cannot be made from a message is
            re-raised itself, the path in its notes).

    Source: Megatron-LM ``megatron/core/transformer/spec_utils.py`` (``build_module``).
    """
    module = _resolve(spec_or_module)
    if isinstance(module, _FUNCTION_TYPES):
        return module
    params = {}
    if isinstance(spec_or_module, ModuleSpec):
        if not isinstance(spec_or_module.params, dict):
            raise TypeError(f"the spec of {module.__name__} must have params as a dict of keyword "
                            f"arguments, got {type(spec_or_module.params).__name__} {spec_or_module.params!r}")
        params = dict(spec_or_module.params)
    clash = sorted(set(params) & set(kwargs))
    if clash:
        raise TypeError(f"the spec of {module.__name__} sets {clash} in params, which its parent passes too")
    if isinstance(spec_or_module, ModuleSpec) and spec_or_module.submodules is not None:
        kwargs["submodules"] = spec_or_module.submodules
    try:
        return module(*args, **params, **kwargs)
    except Exception as e:  # name the module in the error, keeping its type
        where = f"[while building {module.__name__}]"
        if isinstance(e, OSError) and e.errno is not None:  # keep errno and filename: name it in strerror
            error = copy.copy(e)
            error.strerror = f"{e.strerror} {where}"
        else:
            try:
                error = type(e)(f"{e} {where}")
            except Exception:  # a type whose constructor takes other arguments
                error = None
            if error is None:  # the error itself, the module named in its notes
                if hasattr(e, "add_note"):  # Python >= 3.11
                    e.add_note(where)
                raise
        raise error.with_traceback(e.__traceback__) from None  # the traceback keeps the original frames


def check_submodules(owner: str, submodules: Any, expected: type, unused: Tuple[str, ...] = ()) -> Any:
    """Return ``submodules`` if it can serve as ``expected``'s submodules, else raise.

    A module that builds its children from a submodules dataclass (``MLPSubmodules``,
    ``SelfAttentionSubmodules``...) reads its fields by name; anything else failed there with a
    bare ``AttributeError`` about the first field read. Accepted: an ``expected`` instance, or any
    object with the fields of ``expected`` that the module reads as attributes (Megatron-core
    reads them by name too).

    Args:
        owner: the module's name, for the message.
        submodules: what the module was given.
        expected: the submodules dataclass.
        unused: its fields the module never reads (not asked of a stand-in).

    Returns:
        ``submodules``, unchanged.

    Raises:
        TypeError: ``submodules`` lacks some of ``expected``'s fields (None, a dict, another
            module's submodules...), naming what it got and the fields missing.

    Source: fusedlib (Megatron-LM reads the same fields without a check).
    """
    if isinstance(submodules, expected):
        return submodules
    missing = [f.name for f in fields(expected) if f.name not in unused and not hasattr(submodules, f.name)]
    if missing:
        raise TypeError(f"{owner}: submodules must be {expected.__name__} (or have its fields), got {type(submodules).__name__} "
                        f"without {', '.join(missing)}")
    return submodules
