"""What a running step sees: its ``ctx``, and the waits it can park on (signals, child jobs, timers)."""
