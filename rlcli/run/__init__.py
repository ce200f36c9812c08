"""What a run leaves on disk and how it is launched: run state, checkpoints and their manifests, metrics, launch commands."""
