"""A bundle's model config checked before any memory is taken: keyword arguments of the types the
constructors declare, and tensors of the shapes the weights hold."""

from __future__ import annotations

import math
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from vitattn.errors import brief, first_line
from vitattn.models import CaptionDecoder, ImageCaptioner, VisionTransformer

__all__ = ["build_model", "check_arguments"]


class _TooManyTensors(Exception):
    pass


@contextmanager
def _at_most_tensors(limit: int) -> Iterator[None]:
    """Raise ``_TooManyTensors`` in the module constructor that registers parameter number ``limit + 1``."""
    count = 0

    def count_parameter(module: nn.Module, name: str, parameter: Any) -> None:
        nonlocal count
        count += 1
        if count > limit:
            raise _TooManyTensors

    handle = register_module_parameter_registration_hook(count_parameter)
    try:
        yield
    finally:
        handle.remove()


def check_arguments(function: Callable, arguments: Any, where: str, unknown_ok: bool = False) -> None:
    """``arguments`` (a config's mapping) are keyword arguments of ``function`` of the types it declares,
    floats finite: a file's ``"1e-6"`` or ``NaN`` is refused here rather than failing in a forward pass."""
    name = function.__qualname__.removesuffix(".__init__")
    if not isinstance(arguments, Mapping):
        raise ValueError(f"{where} must be a mapping of {name} arguments, got {brief(arguments)}")
    hints = typing.get_type_hints(function)
    for key, value in arguments.items():
        if key not in hints and unknown_ok:
            continue
        if key not in hints:
            raise ValueError(f"{where} has {brief(key)}, which is not a {name} argument")
        allowed = typing.get_args(hints[key]) or (hints[key],)
        ok = (
            (value is None and type(None) in allowed)
            or (isinstance(value, bool) and bool in allowed)
            or (isinstance(value, int) and not isinstance(value, bool) and (int in allowed or float in allowed))
            or (isinstance(value, float) and float in allowed and math.isfinite(value))
            or (isinstance(value, str) and str in allowed)
        )
        if not ok:
            names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(f"{where} has {key}={brief(value)}; it must be {names}")


def _check_config(task: str, model_config: Mapping[str, Any], where: Path) -> None:
    if task == "caption":
        for part, cls in (("encoder", VisionTransformer), ("decoder", CaptionDecoder)):
            check_arguments(cls.__init__, model_config.get(part), f"{where}: model.{part}")
    else:
        check_arguments(VisionTransformer.__init__, model_config, f"{where}: model")


def _construct(task: str, model_config: Mapping[str, Any]) -> nn.Module:
    if task == "caption":
        return ImageCaptioner.from_config(dict(model_config))
    return VisionTransformer(**model_config)


def _integers(value: Any, key: str = "") -> Iterator[tuple[str, int]]:
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _integers(v, f"{key}.{k}" if key else str(k))
    elif isinstance(value, int) and not isinstance(value, bool):
        yield key, value


def _misfit(model: nn.Module, shapes: Mapping[str, tuple[int, ...]]) -> str:
    """What keeps weights of these ``shapes`` from loading into ``model`` (strictly), or ``""``."""
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    aliases: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(parameter), []).append(name)
    saved_once = {name for names in aliases.values() if any(n in shapes for n in names) for name in names}
    for name in expected:
        if name not in shapes and name not in saved_once:
            return f"{name} is missing from the weights"
        if name in shapes and shapes[name] != expected[name]:
            return f"{name} is {list(shapes[name])} in the weights but {list(expected[name])} in the model"
    unexpected = sorted(set(shapes) - set(expected))
    return f"{unexpected[0]} is not in the model" if unexpected else ""


def build_model(task: str, model_config: Any, where: Path, shapes: Mapping[str, Sequence[int]]) -> nn.Module:
    """The ``task`` model of ``model_config``, built once a copy that takes no memory (on the meta device)
    has shown that its tensors have the ``shapes`` (name -> shape) of the weights to be loaded into it.

    A config that does not fit its weights is refused before any memory is taken, however large the
    sizes it names: no size of a model exceeds its number of weights, and the copy stops at the first
    tensor more than the weights hold.
    """
    if not isinstance(model_config, Mapping):
        raise ValueError(f"{where}: the model config must be a mapping, got {type(model_config).__name__}")
    _check_config(task, model_config, where)
    num_weights = sum(math.prod(shape) for shape in shapes.values())
    too_large = [(k, v) for k, v in _integers(model_config) if v > num_weights]
    if too_large:
        key, value = too_large[0]
        raise ValueError(f"{where}: model {key}={value} does not fit weights of {num_weights} numbers")
    try:  # tied weights are registered (and counted) twice, but saved once
        with torch.device("meta"), _at_most_tensors(2 * len(shapes) + 8):
            skeleton = _construct(task, model_config)
    except _TooManyTensors:
        raise ValueError(
            f"{where}: the model config has far more tensors than the {len(shapes)} of its weights"
        ) from None
    except Exception as err:  # noqa: BLE001 - a config can make a constructor fail in any way
        raise ValueError(f"{where}: cannot build the {task} model from its config: {first_line(err)}") from None
    problem = _misfit(skeleton, {name: tuple(shape) for name, shape in shapes.items()})
    if problem:
        raise ValueError(f"{where}: the weights do not fit the model config: {problem}")
    return _construct(task, model_config)
