"""rlinfer backend over the real vllm engine."""
