"""Operator verbs, one implementation for code, the console and the CLI."""
