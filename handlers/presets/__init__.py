"""Named settings a model-config.yaml may choose: chat templates and synthetic device timings.

Data and the pure rules that resolve it, beneath `handlers.config`, which validates the
names at packaging time, and read by the concern that uses them (handlers/api renders the
templates, handlers/backends runs the timings). Nothing here imports the runtime above it.
"""
