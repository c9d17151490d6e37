"""Hosts that run the server core somewhere else than `geserve serve` (Ray Serve): composition roots too."""
