"""``Engine.from_pretrained``'s keyword arguments applied to an ``EngineConfig``.

Sections are given whole (``cache=CacheConfig(num_pages=64)``) and replace the config's;
``load_format``, ``device`` and ``dtype`` are plain keywords that override ``config.load``. The
flat options of earlier releases (``num_pages=64``, ``max_num_seqs=8``, ...) keep working for one
release: each lands in the one section that declares a field of that name, with a
``DeprecationWarning`` naming the new spelling. The flat names are read off the sections' fields,
so an option is declared once, in its section.
"""

from __future__ import annotations

import warnings
from dataclasses import fields, replace
from typing import Any

from phloem.engine.config import EngineConfig

__all__ = ["SECTIONS", "apply_overrides"]

SECTIONS = tuple(f.name for f in fields(EngineConfig))


def _owners() -> dict[str, str]:
    """Flat option name -> the section that declares it."""
    default = EngineConfig()
    owners: dict[str, str] = {}
    for section in SECTIONS:
        for f in fields(getattr(default, section)):
            assert f.name not in owners, f"option {f.name!r} is declared by {owners[f.name]!r} and {section!r}"
            owners[f.name] = section
    return owners


_OWNERS = _owners()


def apply_overrides(
    config: EngineConfig | None, overrides: dict[str, Any], load: dict[str, str | None]
) -> EngineConfig:
    """``config`` (None: ``EngineConfig()``) with ``overrides`` and the ``load`` keywords applied.

    Args:
        config: The base configuration.
        overrides: Whole sections by name, or deprecated flat options by field name.
        load: ``load_format`` / ``device`` / ``dtype`` keywords; None keeps ``config.load``'s.

    Returns:
        The configuration to build the engine from.

    Raises:
        TypeError: ``config`` is not an ``EngineConfig``, an option is unknown, or a flat option
            is given together with the section that declares it.
        ValueError: a value the section rejects (the message names the field).
    """
    config = config if config is not None else EngineConfig()
    if not isinstance(config, EngineConfig):
        raise TypeError(f"Engine.from_pretrained: config: expected an EngineConfig, got {type(config).__name__}")
    unknown = sorted(set(overrides) - set(SECTIONS) - set(_OWNERS))
    if unknown:
        raise TypeError(
            f"Engine.from_pretrained: unknown option(s) {unknown}; expected config=EngineConfig(...), "
            f"a section ({', '.join(SECTIONS)}), load_format, device or dtype"
        )
    sections = {name: value for name, value in overrides.items() if name in SECTIONS}
    config = replace(config, **sections)
    flat: dict[str, dict[str, Any]] = {}
    for name, value in overrides.items():
        if name in _OWNERS:
            flat.setdefault(_OWNERS[name], {})[name] = value
    for section, values in flat.items():
        if section in sections:
            raise TypeError(
                f"Engine.from_pretrained: {sorted(values)} and {section}= both given; put them in the {section} section"
            )
        current = getattr(config, section)
        spelled = ", ".join(f"{name}=..." for name in values)
        warnings.warn(
            f"Engine.from_pretrained({spelled}) is deprecated and will be removed in the next release; "
            f"pass config=EngineConfig({section}={type(current).__name__}({spelled}))",
            DeprecationWarning,
            stacklevel=3,
        )
        config = replace(config, **{section: replace(current, **values)})
    given = {name: value for name, value in load.items() if value is not None}
    return replace(config, load=replace(config.load, **given)) if given else config
