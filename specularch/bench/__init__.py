"""The benchmark runner for the JANUS workloads (``python -m specularch.bench``)."""
