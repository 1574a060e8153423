"""Adapters to other RL frameworks (each imports its framework lazily)."""
