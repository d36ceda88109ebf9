"""tuili bench: load-test any OpenAI-compatible endpoint and report latency percentiles, goodput,
failures by kind and hardware utilization. Every metric is defined in docs/bench.md."""
