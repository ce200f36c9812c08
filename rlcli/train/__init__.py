"""The training loops (RL, SFT, reward-model training), their phases, and the assembly of a run from its config."""
