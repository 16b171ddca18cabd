"""Research tools: the policy replay and its recorder, the n-gram matcher's speed, the
one-pass greedy verification prototype. Not part of the installed package."""
