"""heron's OpenAI-compatible HTTP server: protocol models, admission control, metrics."""
