"""The calling surface: ``auto_shard``'s step object, its plan cache, the call's
signature and names, and the program readers (``--program module:fn``)."""
