"""Batch scoring: predictions and embeddings, in parallel parts."""
