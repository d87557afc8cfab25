"""Modules serving engines load in their own Python environments (this folder goes on the engine's
PYTHONPATH); eyas never imports them."""
