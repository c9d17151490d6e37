"""`geserve tune`: Triton's Model Analyzer, built in — sweeps a model's serving configuration with perf_analyzer
and writes the best one within a latency budget, a report and a throughput-latency plot."""
