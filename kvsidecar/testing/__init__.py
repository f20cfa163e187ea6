"""Real components for tests, the demo and the benchmarks: models and a llama-server process.

Nothing here is imported by the daemon itself.
"""
