"""RL algorithms: advantage estimators and policy losses, each one module found by its name
(registry.py), plus the off-policy correction, dynamic sampling and overlong shaping."""
