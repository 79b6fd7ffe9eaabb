"""Apex's opt-level objects, ``O0`` ... ``O3`` and ``opt_levels``, on amp's presets (``options.OPT_LEVELS``).

Apex-era code reads ``opt_levels["O2"].brief`` or applies a preset to a ``Properties``
(``O2()(properties)``); ``amp.frontend`` keeps them under Apex's names. ROCm Apex's ``O4`` and
``O5`` are here too.
"""
from __future__ import annotations

from typing import Any

from .options import OPT_LEVELS

__all__ = ["O0", "O1", "O2", "O3", "O4", "O5", "opt_levels"]


class _Preset:
    """One opt level: ``brief`` and ``more`` describe it; calling it on a ``Properties`` sets its options."""

    name = ""
    brief = ""
    more = ""

    def __call__(self, properties: Any) -> Any:
        properties.enabled = True
        properties.opt_level = self.name
        for option, value in OPT_LEVELS[self.name].options.items():
            setattr(properties, option, value)
        return properties


def _preset(name: str) -> type[_Preset]:
    level = OPT_LEVELS[name]
    more = ", ".join(f"{option}={value}" for option, value in level.options.items())
    return type(name, (_Preset,), dict(name=name, brief=f"{name}:  {level.brief}\n", more=more + "\n",
                                       __doc__=f"Apex's preset object for opt level {name}."))


O0, O1, O2, O3, O4, O5 = (_preset(name) for name in ("O0", "O1", "O2", "O3", "O4", "O5"))
opt_levels = {name: preset() for name, preset in zip(("O3", "O2", "O1", "O0", "O4", "O5"), (O3, O2, O1, O0, O4, O5))}
