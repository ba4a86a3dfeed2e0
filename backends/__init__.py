"""Chip backends, one folder per chip family; each is a plugin registered under `flagdeploy.backends`."""
