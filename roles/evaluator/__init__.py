"""The evaluator role: held-out accuracy of the newest weights (role.py)."""
