"""The large-model benchmark (``python -m benchmarks large-model``): a GPT-style family with AdamW, the largest
member that fits a device without and with the optimizer state on the host, derived from narrow captures."""
