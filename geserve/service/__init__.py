"""The one front door: every call of every protocol, with its call context, grouped by Triton's API groups."""
