"""http_api: OpenAI's HTTP API in front of kvserve's gRPC front door (`kvserve http`, `python -m http_api`)."""
