"""The model repository: what is on disk (store), the ensemble dependency graph (dependencies), the builder of a
servable model (builder), one model's versions (versions) and the manager that drives them (lifecycle)."""
