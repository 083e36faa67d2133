"""Where training runs (the executor) and where it is recorded (MLflow tracking)."""
