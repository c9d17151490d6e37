"""Calls between the processes of one server: the supervisor and its workers, a Python model and its own process."""
