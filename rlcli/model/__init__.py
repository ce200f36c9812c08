"""The trained Megatron model: its build options, heads, LoRA, and where it lives in each phase."""
