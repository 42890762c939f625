"""The reference OpenAI-compatible vision server (layer 4)."""
