"""What the daily outputs keep unless a project says otherwise, declared once: the project config
(pipelines/config/project.py, which reads this without torch) and the functions that score and explain
(models/serve/predict.py, models/explain/) take their defaults from here."""

# predictions: labels (multilabel) and items (recommendation) kept per entity, best first
TOP_K = 20

# explanations (models/explain/; their cost: docs/explanations.md, "Cost")
DEFAULT_TOP = 5  # reasons kept per entity and score
DEFAULT_STEPS = 8  # Gauss-Legendre points of the first pass; pairs over the tolerance are integrated again
SELECT = ("top", "sample", "all")  # which scored entities are explained: the highest, a random share, all
DEFAULT_SELECT, DEFAULT_SHARE = "top", 0.1
