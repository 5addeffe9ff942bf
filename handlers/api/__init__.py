"""The HTTP surface: what a request body becomes before it runs, and how its answer is
written. The native API (`native`, `request`) and the OpenAI-compatible one (`openai*`)
share one request contract; `routes` picks the API by path. Nothing here runs a model."""
