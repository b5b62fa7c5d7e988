"""Text in, tokens out: `prepare` turns sources into a data directory of token shards."""

from .prepare import PrepareResult, prepare
from .shards import DataError

__all__ = ["prepare", "PrepareResult", "DataError"]
