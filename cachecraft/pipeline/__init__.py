"""One request end to end: retrieve -> plan -> load -> blend -> generate -> record.

The reports load without torch (a client of ``cachecraft serve`` prints them); the
pipeline itself is imported on first use.
"""

from cachecraft.pipeline.reports import Answer, ChunkReport, PrefillTrace, Source, WarmReport

__all__ = ["Answer", "ChunkReport", "Pipeline", "PrefillTrace", "PreparedRequest", "Retrieved", "Source",
           "WarmReport"]


def __getattr__(name: str):
    if name in ("Pipeline", "PreparedRequest", "Retrieved"):
        from cachecraft.pipeline import core
        return getattr(core, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
