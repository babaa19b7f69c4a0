"""One request end to end: retrieve -> plan -> load -> blend -> generate -> record."""

from cachecraft.pipeline.core import Pipeline, PreparedRequest
from cachecraft.pipeline.reports import Answer, ChunkReport, PrefillTrace, Source, WarmReport

__all__ = ["Answer", "ChunkReport", "Pipeline", "PrefillTrace", "PreparedRequest", "Source", "WarmReport"]
