"""The engine: scheduler and generation loop (`core`, `scheduler`), detokenization and
stop strings (`detokenize`), the engine process with the worker's handle on it
(`process`, `client`, `messages`, `start`), the guardian that answers for a dead worker
(`guardian`) and the numbers the three read of one another (`board`). Pure Python but for
the backend it drives."""
