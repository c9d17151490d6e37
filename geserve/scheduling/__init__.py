"""Scheduling: the scheduler protocol and factory, direct and dynamic batching, queue policies, instance pool."""
