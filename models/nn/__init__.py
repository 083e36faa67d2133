"""The networks, their adapters, quantization and checkpoints."""
