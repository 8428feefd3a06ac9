"""diffuse/client."""
