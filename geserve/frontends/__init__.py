"""Frontends: thin translators between wire protocols (HTTP, gRPC, metrics) and the data plane."""
