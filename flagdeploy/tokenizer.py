"""Tokenizer and chat template, taken from the model's own files (HF tokenizer files or GGUF metadata)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from functools import cached_property
from pathlib import Path
from typing import Any

from flagdeploy.errors import ModelLoadError

log = logging.getLogger(__name__)


class Tokenizer:
    """A thin wrapper over a transformers tokenizer: encoding, decoding, the chat template, stop ids."""

    def __init__(self, hf_tokenizer, extra_eos_ids: list[int] | None = None):
        self.hf = hf_tokenizer
        eos = {i for i in [hf_tokenizer.eos_token_id, *(extra_eos_ids or [])] if i is not None}
        self.eos_token_ids: frozenset[int] = frozenset(eos)

    @classmethod
    def from_source(cls, path: Path, fmt: str, extra_eos_ids: list[int] | None = None) -> "Tokenizer":
        try:
            if fmt == "gguf":
                tok = _gguf_tokenizer(path)
            else:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(str(path))
                template = chat_template_source(path)
                if isinstance(template, str):  # named templates (a list) stay as transformers read them
                    tok.chat_template = template
        except Exception as exc:
            raise ModelLoadError(
                f"The tokenizer of {path} could not be loaded ({exc}). A GGUF file must carry its "
                f"tokenizer; a safetensors directory needs tokenizer.json / tokenizer_config.json."
            ) from exc
        return cls(tok, extra_eos_ids)

    @cached_property
    def content_format(self) -> str:
        """How the chat template reads a message's content: "openai" when it loops over it as a list of
        typed parts (multimodal templates: `{% for part in message['content'] %}`), "string" otherwise.
        `apply_chat_template` hands it text in that form (vLLM's `--chat-template-content-format auto`)."""
        template = getattr(self.hf, "chat_template", None)
        if not isinstance(template, str):
            return "string"
        import jinja2
        from jinja2 import nodes

        try:
            tree = jinja2.Environment().parse(template)
        except jinja2.TemplateSyntaxError:
            return "string"
        for loop in tree.find_all(nodes.For):
            it = loop.iter
            if (isinstance(it, nodes.Getattr) and it.attr == "content") or (
                    isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content"):
                return "openai"
        return "string"

    @cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token stands for (its vocabulary spelling: a byte-level
        token spells one character per byte, a byte-fallback token more than its one byte), so that
        `len(text) / max_token_chars` tokens is a lower bound for any text, known without tokenizing."""
        spellings = self.hf.convert_ids_to_tokens(list(range(len(self.hf))))
        return max(1, max(len(s) for s in spellings if s is not None))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._rust_decode is not None and type(ids) is list:
            return self._rust_decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    @cached_property
    def _rust_decode(self):
        """The `tokenizers` library's own decode where transformers' adds nothing to it (a fast tokenizer that
        cleans up no spaces): the same text without transformers' argument handling, which, run between two
        decode steps that have swept the CPU's caches, cost ~60 us of a token's two decodes (the default model,
        one stream, 2-core EPYC), several times the decode itself."""
        backend = getattr(self.hf, "_tokenizer", None)
        if not getattr(self.hf, "is_fast", False) or getattr(self.hf, "clean_up_tokenization_spaces", True) \
                or not callable(getattr(backend, "decode", None)):
            return None
        return backend.decode

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list | None = None, **kwargs
    ) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("This model has no chat template; use /v1/completions with a plain prompt.")
        if self.content_format == "openai":
            messages = [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str)
                        else m for m in messages]
        return self.hf.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )


def _gguf_tokenizer(path: Path):
    """A GGUF's tokenizer, converted by transformers once and then read back from its saved form: the
    conversion parses the file's whole vocabulary and merges from the GGUF metadata (seconds of a server's
    start on a small CPU), the saved tokenizer.json loads in a fraction of that. Kept under the cache
    directory by file, size, modification time and transformers version; a cache that cannot be written
    or read is skipped, never an error."""
    import transformers

    from flagdeploy.checkpoints.source import cache_dir

    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}".encode())
    saved = cache_dir() / "tokenizers" / key.hexdigest()[:16]
    if saved.is_dir():
        try:
            return _saved_tokenizer(saved)
        except Exception as exc:  # noqa: BLE001 (a damaged cache entry: convert again)
            log.warning("the cached tokenizer %s could not be read (%s); converting the GGUF's again", saved, exc)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=saved.parent, prefix=f".{saved.name}-"))
        tok.save_pretrained(str(tmp))
        try:
            os.rename(tmp, saved)  # whole or not at all; another process may have just written the same
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        log.info("not caching the converted tokenizer (%s)", exc)
    return tok


def _saved_tokenizer(saved: Path):
    """A converted GGUF tokenizer read back: what a conversion writes is a plain tokenizer.json, which the
    fast tokenizer class reads directly. AutoTokenizer would first map every model family's classes (about
    a second of a server's start); it is the fallback for any other class name."""
    from flagdeploy.checkpoints.safetensors_reader import optional_json

    config = optional_json(saved / "tokenizer_config.json") or {}
    if config.get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        from transformers.tokenization_utils_tokenizers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(saved))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(saved))


def chat_template_source(path: Path) -> str | list | None:
    """The chat template of a checkpoint directory, by the one precedence both the builtin engine's prompt
    (`Tokenizer.from_source`) and the gateway's prompt count (gateway/tokens.py) read it with: a multimodal
    processor's (chat_template.json, as SmolVLM ships it: it writes the media placeholders, and transformers'
    `processor.apply_chat_template` uses it too), then chat_template.jinja (transformers >= 4.43 saves it beside
    the config), then tokenizer_config.json's (a list: named templates). None: the checkpoint has none."""
    from flagdeploy.checkpoints.safetensors_reader import optional_json

    template = (optional_json(path / "chat_template.json") or {}).get("chat_template")
    if isinstance(template, str):
        return template
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    template = (optional_json(path / "tokenizer_config.json") or {}).get("chat_template")
    return template if isinstance(template, (str, list)) else None


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas without re-decoding the whole output each step.

    Decodes a small window ending at the new token and emits only what is stable: a trailing
    U+FFFD means a multi-byte character is still incomplete, so it waits for the next token.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""
