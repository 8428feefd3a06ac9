"""diffuse/wire."""
