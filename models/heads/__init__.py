"""The head chosen on validation: the network, trees over its representation, their blend; re-ranking."""
