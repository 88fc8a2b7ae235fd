"""Discrete-event cluster simulator driving the real router, index and store policies."""
