"""Launch configurations overridden from the environment (tile sweeps, GPUs other than the H200),
and whether the kernels run under the Triton interpreter (``interpreting``).

``env_config("PHLOEM_X_CONFIG", XConfig)`` reads ``"a,b,c"`` into the ``NamedTuple`` ``XConfig`` (one
integer per field, trailing fields with defaults may be left out; booleans as ``0``/``1``), or
returns None when the variable is unset or empty.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["env_config", "interpreting", "parse_config"]


def interpreting() -> bool:
    """The kernels run under the Triton interpreter (``TRITON_INTERPRET`` set, not ``0``): inline PTX
    and ``griddepcontrol`` are not available there."""
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def env_config(var: str, cls: Any) -> Any:
    """``cls`` from the comma-separated integers in ``var``, or None if unset.

    Raises:
        ValueError: not one integer per field (the trailing defaulted ones optional).
    """
    text = os.environ.get(var, "").strip()
    return parse_config(text, cls, var) if text else None


def parse_config(text: str, cls: Any, var: str) -> Any:
    """``cls`` from the comma-separated integers ``text`` (a part of ``var``'s value, named in the error).

    Raises:
        ValueError: not one integer per field (the trailing defaulted ones optional).
    """
    fields = cls._fields
    required = len(fields) - len(getattr(cls, "_field_defaults", {}))
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not required <= len(values) <= len(fields) or not values:
        count = f"{required} to {len(fields)}" if required < len(fields) else f"{len(fields)}"
        raise ValueError(f"{var}: expected {count} comma-separated integers ({', '.join(fields)}), got {text!r}")
    return cls(*values)
