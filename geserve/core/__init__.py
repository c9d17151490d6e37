"""The protocol-neutral core: data plane, validation, classification, statistics, shared memory, server."""
