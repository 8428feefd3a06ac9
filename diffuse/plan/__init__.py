"""diffuse/plan."""
