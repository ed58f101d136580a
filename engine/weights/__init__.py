"""Weight sync: moving a trainer's weights into the engine's workers (docs/weight-sync.md).

See docs/architecture.md, "Weight sync", for the path from the trainer to the worker.
"""
