"""Rewards computed by models: a reward model on Megatron and a generative judge on an engine, scored in their own phases of the step."""
