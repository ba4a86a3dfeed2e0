"""flagdeploy: one model, the chips you own, one OpenAI/Anthropic-compatible endpoint."""

__version__ = "0.1.0"
