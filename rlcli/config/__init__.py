"""The config's typed sections (what a recipe may say), each choice declared once."""
