"""Policy parameters fitted by ``cachecraft calibrate`` for the bundled models, shipped so
that a fresh install answers with them before anyone calibrates.

A model's own calibration (in the catalog, by fingerprint) wins over these, and a value
set in the config wins over both. Each entry records the run that fitted it.
"""

from __future__ import annotations

import copy

SHIPPED_FITS: dict[str, dict] = {}


def shipped_fit(model: str) -> dict | None:
    """The shipped profile for bundled model ``model`` (by name), or None."""
    fit = SHIPPED_FITS.get(str(model))
    return copy.deepcopy(fit) if fit is not None else None
