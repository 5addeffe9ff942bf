"""The engine: scheduler and generation loop (`core`, `scheduler`), detokenization and
stop strings (`detokenize`), and the engine process with the worker's handle on it
(`process`, `client`, `messages`, `start`). Pure Python but for the backend it drives."""
