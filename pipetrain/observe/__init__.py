"""Observability: progress lines, step metrics, traces and timelines, the activation-memory
ledger, layer profiling."""
