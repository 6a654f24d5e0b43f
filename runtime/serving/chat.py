"""Chat prompts from a GGUF's own template (``tokenizer.chat_template``), as HF and llama.cpp
apply it: a Jinja template rendered in a sandbox with ``messages``, ``add_generation_prompt``,
``bos_token`` and ``eos_token``. A model without a template gets no chat route: the server
answers with an error that says so rather than guessing a format."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ggufswap.runtime.serving.errors import ChatTemplateError

CHAT_TEMPLATE_KEY: Final = "tokenizer.chat_template"
ROLES: Final = ("system", "user", "assistant")


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


class ChatTemplate:
    """A compiled chat template with the model's BOS and EOS token texts."""

    def __init__(self, source: str, *, bos_token: str, eos_token: str) -> None:
        # HF's settings (transformers' _compile_jinja_template): blocks trimmed, sandboxed.
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{CHAT_TEMPLATE_KEY} does not compile: {exc}") from None
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_metadata(
        cls, metadata: Mapping[str, Any], *, bos_token: str, eos_token: str
    ) -> ChatTemplate | None:
        """The model's template, or None when its GGUF has none."""
        source = metadata.get(CHAT_TEMPLATE_KEY)
        if not isinstance(source, str) or not source.strip():
            return None
        return cls(source, bos_token=bos_token, eos_token=eos_token)

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt text of ``messages`` followed by the assistant's turn opening."""
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template failed: {exc}") from None


__all__ = ["CHAT_TEMPLATE_KEY", "ChatTemplate", "ChatTemplateError"]
