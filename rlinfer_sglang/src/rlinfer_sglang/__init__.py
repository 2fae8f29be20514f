"""rlinfer backend over the real sglang engine."""
