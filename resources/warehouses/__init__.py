"""The warehouse connectors and what they share: SQL, row filters, the canonical schema, errors, retries,
masked secrets."""
