"""Models: the policy (a tiny SD3-style MMDiT behind a narrow interface) and the reward classifiers."""
