"""The coordinator process: actor.py (numbers, broadcasts and collects the acks of control commands;
watches liveness) and engine.weights.lifecycle (the pure step sequence of a bus-driven weight update)."""
