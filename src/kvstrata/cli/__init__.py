"""Command-line entry points. Argument parsing and printing only; logic lives elsewhere."""
