"""The `inf2serve` command line: demo models, packaging, serving, cache tools."""
