"""The orchestrator's tokenizer: a prompt's text to token ids, a chat's
messages through the model's template, and generated ids back to text,
without torch.

The orchestrator never touches a tensor, but `transformers.AutoTokenizer`
imports torch (its configuration code does), which cost the orchestrator
most of its start-up and memory. A model directory that ships
`tokenizer.json` (every model `specd models fetch` converts, and the
tokenizer donors of the synthetic models) needs no more than the
`tokenizers` library reading that file, as transformers' fast tokenizers do
themselves. What transformers adds around it, kept here the same:

- `tokenizer_config.json`'s named special tokens (`eos_token_id`, and the
  chat template's variables);
- the chat template: `chat_template.jinja` when it exists, else the config's
  `chat_template` (a string, or the one named "default"), rendered by
  transformers' own renderer (`render_jinja_template`, which imports no
  torch) with the same variables, then encoded without special tokens.

Anything else (a GGUF file, a directory without `tokenizer.json`) still goes
through `AutoTokenizer`. tests/test_tokenizer.py checks that both give the
same ids and text.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

# transformers' named special tokens (`SpecialTokensMixin.SPECIAL_TOKENS_ATTRIBUTES`):
# the variables a chat template may use besides the messages.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TextTokenizer:
    """A fast tokenizer from `tokenizer.json`, with the small part of
    transformers' `PreTrainedTokenizerFast` the orchestrator calls."""

    def __init__(self, backend, config: dict, chat_template: str | None = None):
        self._backend = backend
        self.chat_template = chat_template
        self.special_tokens_map = {name: token for name in SPECIAL_TOKEN_NAMES
                                   if (token := _token_text(config.get(name))) is not None}
        eos = self.special_tokens_map.get("eos_token")
        self.eos_token_id = backend.token_to_id(eos) if eos is not None else None
        self._render = None

    @classmethod
    def from_directory(cls, directory: str | Path) -> TextTokenizer | None:
        """The directory's tokenizer, or None when it ships no `tokenizer.json`."""
        directory = Path(directory)
        if not (directory / "tokenizer.json").is_file():
            return None
        from tokenizers import Tokenizer

        config_file = directory / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        tokenizer = cls(Tokenizer.from_file(str(directory / "tokenizer.json")), config,
                        _chat_template(directory, config))
        if tokenizer.chat_template:
            tokenizer._renderer()  # its import now, at start-up, not in the first chat request
        return tokenizer

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # As a batch of one: the same ids, and the batch call releases the GIL
        # while it runs (a long prompt tokenized on a worker thread leaves the
        # event loop free; a plain `encode` holds the GIL throughout).
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False) -> str:
        """The ids' text, as the tokenizer's decoder makes it. Never cleaned
        up (transformers' `clean_up_tokenization_spaces`, which removes spaces
        before punctuation): the orchestrator's incremental detokenizer needs
        the text of a prefix to be a prefix of the whole's."""
        if clean_up_tokenization_spaces:
            raise ValueError("TextTokenizer.decode does not clean up tokenization spaces")
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True) -> list[int] | str:
        """The messages through the chat template: the token ids, or the text
        when `tokenize` is False (transformers' `apply_chat_template` with its
        defaults otherwise)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        conversation = [{key: value for key, value in message.items() if value is not None} for message in messages]
        rendered, _ = self._renderer()(conversations=[conversation], chat_template=self.chat_template,
                                       add_generation_prompt=add_generation_prompt, **self.special_tokens_map)
        return self.encode(rendered[0], add_special_tokens=False) if tokenize else rendered[0]

    def _renderer(self):
        if self._render is None:
            from transformers.utils.chat_template_utils import render_jinja_template

            self._render = render_jinja_template
        return self._render


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or an
    AddedToken's fields ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(directory: Path, config: dict) -> str | None:
    """The default chat template, where transformers looks for it: the
    `chat_template.jinja` file first, then the config's entry."""
    file = directory / "chat_template.jinja"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default", next(iter(named.values())) if len(named) == 1 else None)
    return template if isinstance(template, str) else None


def load_tokenizer(name: str):
    """A tokenizer from a catalog name, a synthetic model's name or a
    directory; None when there is none. A `TextTokenizer` where the files
    allow, else transformers' `AutoTokenizer` (which imports torch)."""
    if not name:
        return None
    from specdec.models import synth

    if synth.is_synth_name(name):
        directory = synth.tokenizer_dir(name)  # a donor's directory, with its tokenizer.json
        return TextTokenizer.from_directory(directory) if directory is not None else synth.load_tokenizer(name)
    from specdec.models.cache import locate

    try:
        where, gguf_file = locate(name)
        if gguf_file is None and (tokenizer := TextTokenizer.from_directory(where)) is not None:
            return tokenizer
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(where, **({"gguf_file": gguf_file} if gguf_file else {}))
    except (OSError, ValueError, LookupError) as exc:
        log.warning("no tokenizer from %r (%s): only prompt_token_ids requests will work", name, exc)
        return None


def end_ids(model_eos_ids, tokenizer) -> frozenset[int]:
    """The token ids that end a request: the target model's EOS ids and its
    tokenizer's EOS id (a model's generation config and its tokenizer may
    each name one the other does not)."""
    ids = {int(t) for t in model_eos_ids}
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
