"""Saved KV states of prompts: in RAM and on disk."""
