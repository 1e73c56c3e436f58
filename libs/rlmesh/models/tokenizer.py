"""A character-level tokenizer built from a fixed local vocabulary (no hub, no training).

docs/internals.md#rlmeshmodelstokenizer"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"  # eos and pad, as in Qwen2 base models
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END, UNK_TOKEN)
CHARS = ("\n", *(chr(i) for i in range(32, 127)))

# ChatML as in Qwen2, minus Qwen's default system message: a tiny char-level model has ~64-128
# tokens of context per prompt and "You are a helpful assistant." alone would cost ~60 of them.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


CHAR_TOKENIZER_MARKER = "rlmesh_char_tokenizer"


def load_tokenizer(
    path: str | Path, *, chat_template: str | None = None, **kwargs: object
) -> PreTrainedTokenizerBase:
    """The tokenizer saved at ``path``: rlmesh's char tokenizer exactly as saved, any other one
    through ``AutoTokenizer``. Use this, not ``AutoTokenizer``, wherever rlmesh loads a tokenizer;
    where it renders prompts, pass ``chat_template=actor_rollout_ref.model.custom_chat_template``
    (a Jinja template that replaces the tokenizer's own, as verl's ``HFModelConfig`` does; None
    keeps it)."""
    from transformers import AutoTokenizer

    path = Path(path).expanduser()
    config = path / "tokenizer_config.json"
    if config.exists() and json.loads(config.read_text()).get(CHAR_TOKENIZER_MARKER):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(path), **kwargs)
        if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
            # As verl's hf_tokenizer does: Llama's tokenizers have no pad token, batches need one.
            tokenizer.pad_token = tokenizer.eos_token
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def build_tokenizer(out_dir: str | Path | None = None, words: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """The char-level tokenizer; saved with ``save_pretrained(out_dir)`` when out_dir is given.

    ``words`` become whole tokens (ids from 100 on, in order), matched in text before the
    per-character split as a BPE vocabulary's merges would be: a prompt's fixed wording then costs a
    few tokens instead of one per character, and encode -> decode still gives back the text.
    """
    vocab = {tok: i for i, tok in enumerate((*CHARS, *SPECIAL_TOKENS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # [\s\S] rather than "." so that newlines are split off too.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    # Special tokens are matched before pre-tokenization, so "<|im_end|>" in text is one token.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if words:
        bad = [w for w in words if not w or w in vocab or any(c not in CHARS for c in w)]
        if bad:
            raise ValueError(f"build_tokenizer words must be new strings of printable ASCII: {bad!r}")
        tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in words])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # True would turn "a ." into "a." on decode
    )
    if out_dir is not None:
        save_tokenizer(hf, out_dir)
    return hf


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> Path:
    """``save_pretrained`` plus a tokenizer_config.json that older transformers (4.x, e.g. in an
    SGLang image) can read too: a class name both know, the list-valued special tokens under the
    4.x key, and the chat template inline as well as in chat_template.jinja."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    # transformers 5's AutoTokenizer swaps in the model type's tokenizer class (Qwen2Tokenizer,
    # whose byte-level pre-tokenizer drops our spaces) when a config.json sits beside this file;
    # load_tokenizer sees this marker and loads the files as they are.
    cfg[CHAR_TOKENIZER_MARKER] = True
    extra = cfg.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        cfg["additional_special_tokens"] = extra
    if tokenizer.chat_template:
        cfg["chat_template"] = tokenizer.chat_template
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out
