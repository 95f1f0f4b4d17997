"""Pure rules, no database: workflows and their transition tables, retry, identity, text forms.

Everything else builds on these; they import nothing of durable but the settings and errors.
"""
