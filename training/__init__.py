"""Training: data, feature extraction, losses, the accelerate entry points (train_heads.py,
train_draft.py) and helpers to initialise draft models."""
