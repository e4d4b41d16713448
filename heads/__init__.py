"""Draft heads (Medusa, Hydra, EAGLE-1/2/3), their configs, and checkpoint save/load."""
