"""Backends: the Backend / ModelInstance protocols, the registry, and the GE backend."""
