"""Floor 2: serving state and steps (pool specs, KV pools, pooled attention, kernel dispatch)."""
