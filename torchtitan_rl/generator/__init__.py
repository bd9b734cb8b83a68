"""The generator: our torchtitan model served by an in-process vLLM engine."""
