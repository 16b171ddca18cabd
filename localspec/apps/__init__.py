"""The front ends' logic: chat, summarize, editor protocol, HTTP API, doctor."""
