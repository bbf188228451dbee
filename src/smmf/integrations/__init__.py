"""Integrations with training frameworks, kept outside the optimizer core."""
