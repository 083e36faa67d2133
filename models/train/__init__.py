"""The training loops: foundation, fine-tuning, resume, several processes."""
