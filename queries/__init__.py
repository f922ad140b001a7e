"""Stage 4: named SQL over the manifest, the query runner, and the report.

Reads the store only, on read-only connections; never loads a model.
"""

from queries.named import NamedQuery, QueryError, available, get, run

__all__ = ["NamedQuery", "QueryError", "available", "get", "run"]
