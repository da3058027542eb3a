"""Observability: the metrics logger, phase timers, the profiler window, energy, slow ranks, FLOP counts."""
