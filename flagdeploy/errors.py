"""Errors a user can act on: each message says what was wrong, what was expected and what to do."""


class FlagdeployError(Exception):
    """Base for every error flagdeploy raises on purpose (the CLI prints these without a traceback)."""


class PromptTooLongError(FlagdeployError, ValueError):
    """The prompt (plus at least one generated token) does not fit the model's context window."""

    def __init__(self, num_prompt_tokens: int, max_model_len: int):
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len
        super().__init__(
            f"The prompt is too long: this model's maximum context length is {max_model_len} tokens, but the "
            f"prompt has {num_prompt_tokens} tokens, which leaves no room to generate. Shorten the prompt or the "
            f"conversation, or restart the server with a larger --max-model-len."
        )


class ConfigError(FlagdeployError, ValueError):
    """A setting the engine refuses at start-up (memory that does not fit, speculation the model cannot
    run): the message names the flag to change. A ValueError too, for callers that catch those."""


class ModelLoadError(FlagdeployError):
    """A model file or directory could not be turned into a runnable model."""


class UnknownChipError(FlagdeployError, KeyError):
    """No installed backend, or no chip in the catalog, has that name."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])
