"""The operators' questions answered as plain data: reports, failure groups, alerts, metrics."""
