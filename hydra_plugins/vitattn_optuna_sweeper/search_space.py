"""``hydra.sweeper.params`` and the command line's sweeps as Optuna distributions.

The syntax is Hydra's override grammar, as with Hydra's own Optuna sweeper: ``choice(1, 2, 4)`` is
categorical, ``range(1, 9)`` (``range(0.1, 1.0, 0.1)``) steps through integers (floats), ``interval(0.0,
0.1)`` is uniform and ``tag(log, interval(1e-4, 1e-2))`` log-uniform; a key given one value is fixed.
"""

from __future__ import annotations

from typing import Any

import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override, RangeSweep, Transformer
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution


def search_space(overrides: list[str]) -> tuple[dict[str, BaseDistribution], dict[str, str]]:
    """Split overrides into the searched keys' distributions and the fixed keys' values; a later override
    of a key replaces an earlier one (the command line over ``hydra.sweeper.params``)."""
    space: dict[str, BaseDistribution] = {}
    fixed: dict[str, str] = {}
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.get_key_element()
        space.pop(key, None)
        fixed.pop(key, None)
        if override.is_sweep_override():
            space[key] = distribution(override)
        else:
            fixed[key] = override.get_value_element_as_str()
    return space, fixed


def distribution(override: Override) -> BaseDistribution:
    """The Optuna distribution of one sweep override."""
    value = override.value()
    if override.is_choice_sweep() or (override.is_range_sweep() and value.shuffle):
        return CategoricalDistribution(list(override.sweep_iterator(transformer=Transformer.encode)))
    if override.is_range_sweep():
        assert isinstance(value, RangeSweep)
        if any(isinstance(v, float) for v in (value.start, value.stop, value.step)):
            # range's stop is exclusive, Optuna's high inclusive
            return FloatDistribution(value.start, value.stop - value.step, step=value.step)
        return IntDistribution(int(value.start), int(value.stop) - int(value.step), step=int(value.step))
    if override.is_interval_sweep():
        assert isinstance(value, IntervalSweep)
        log = "log" in value.tags
        if isinstance(value.start, int) and isinstance(value.end, int):
            return IntDistribution(value.start, value.end, log=log)
        return FloatDistribution(value.start, value.end, log=log)
    raise ValueError(f"{override.input_line}: the Optuna sweeper searches choice, range and interval sweeps only")


def suggest(trial: optuna.Trial, space: dict[str, BaseDistribution]) -> dict[str, Any]:
    """Ask ``trial`` for a value of every searched key, through the public ``suggest_*`` API."""
    for name, dist in space.items():
        if isinstance(dist, CategoricalDistribution):
            trial.suggest_categorical(name, dist.choices)
        elif isinstance(dist, IntDistribution):
            trial.suggest_int(name, dist.low, dist.high, step=dist.step, log=dist.log)
        else:
            trial.suggest_float(name, dist.low, dist.high, step=dist.step, log=dist.log)
    return trial.params
