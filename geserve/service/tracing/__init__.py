"""Request tracing (Triton's trace extension): which requests are traced, and their trace file or OTLP spans."""
