"""The dsv41 FX passes: one file per fusion, the pass manager, normalisation, streams, defunctionalisation."""

from __future__ import annotations

import importlib

from dsv41.passes.registry import FUSION_NAMES as FUSION_ORDER  # the run order (see dsv41.passes.registry)


def fusion_pass_class(name: str):
    module = importlib.import_module(f"dsv41.passes.{name}")
    return next(v for v in vars(module).values() if isinstance(v, type) and getattr(v, "name", None) == name)


def build_passes(config) -> list:
    """The passes in the order they run for `config` (disabled fusions are left out)."""
    from dsv41.passes.decompose import DecomposePass
    from dsv41.passes.defunctionalize import DefunctionalizePass
    from dsv41.passes.manager import NormalizePass, RestoreStableSortsPass
    from dsv41.passes.lower_references import LowerReferencesPass
    from dsv41.passes.streams import StreamSchedulePass

    passes = [NormalizePass(config)]
    passes += [fusion_pass_class(name)(config) for name in FUSION_ORDER if name in config.fusions]
    passes += [RestoreStableSortsPass(config), DecomposePass(config), StreamSchedulePass(config),
               LowerReferencesPass(config), DefunctionalizePass(config)]
    return passes
