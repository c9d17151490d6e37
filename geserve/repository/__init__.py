"""The model repository: what is on disk (store) and per-version load/unload state (lifecycle)."""
