"""Frontends: thin translators between wire protocols (HTTP, gRPC, metrics) and geserve.service."""
