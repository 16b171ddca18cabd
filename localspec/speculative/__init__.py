"""The speculative core: sampling, proposers, verifier, step, engine."""
