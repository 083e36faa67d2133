"""What a cut-off lets the model see (features, label histories) and what it labels (targets)."""
