"""Runtime of inf2serve: the TorchServe handler, the scheduler and the model backends.

This package travels inside every archive, so it must import without torch,
transformers or TorchServe: those are imported only by the modules that run models.
"""
