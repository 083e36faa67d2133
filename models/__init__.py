"""The engine: pure PyTorch / NumPy / Arrow, usable without Dagster. Its rooms, bottom to top:

    storage < cache < data < nn < tasks < evaluate < heads < train < serve < explain

A module imports its own room and the rooms below it, never one above (tests/pipelines/test_layers.py):

- storage: files, locks, the heap; the floor every package may use;
- cache: the model-ready columns built from the warehouse's events;
- data: what a cut-off lets a model see (features, label histories) and what it labels (targets);
- nn: the networks, LoRA, quantization, checkpoints;
- tasks: the task types, one module each behind one registry; each owns every decision that
  differs by task (its head, loss, metrics, baselines, its re-ranking trees, how the head chosen
  on validation treats its scores), so no module above compares a task's name;
- evaluate: the hold-out and the practitioner's baselines (hand features, LightGBM);
- heads: the head chosen on validation, trees over [the baseline's hand features + the
  foundation's representation] blended with the network;
- train: the training loops and the scenario recipe, which fine-tunes, fits the head and holds
  out (so it sits above heads and evaluate);
- serve: batch scoring, in parallel parts;
- explain: why a served score is what it is.
"""
