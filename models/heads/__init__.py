"""The head chosen on validation: the network, trees over [hand features + the foundation's representation], or their blend."""
