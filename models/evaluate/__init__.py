"""The temporal hold-out of a scenario, and the practitioner's baselines it is measured against (hand features, LightGBM)."""
