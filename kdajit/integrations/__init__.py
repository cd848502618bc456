"""Integrations of kdajit with other libraries (each imports its library only when used)."""
