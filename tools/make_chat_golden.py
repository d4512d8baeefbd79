#!/usr/bin/env python3
"""Chat template references for megatrain's `.jsonl` rendering, made with
Hugging Face transformers' own `apply_chat_template`.

For each template below (written for these tests in the shapes of the
families' released templates: a Llama 3 header format with the system
message pulled out and a date line, ChatML with a default system message,
Phi-3's role tags closed by `eos_token`, Mistral's `[INST]` pairs with
`raise_exception` and no generation prompt, and one that leans on
`namespace`, loop controls, Python string methods and `tojson`) and each
conversation, it writes the text transformers renders for the whole
conversation and the assistant turns' text, cut the way
`crates/megatrain/src/data/chat.rs` documents (renders of the messages
before a turn with the generation prompt, and through it; a trailing
`eos_token` only counted where the conversation ends), and the ids
`apply_chat_template(tokenize=True)` gives with the zoo's BPE fixture. The
Rust test `tests/chat_templates.rs` renders the same and compares.

Today's date (`strftime_now("%d %b %Y")`) is written as `<DATE>`.
Usage (from the repository root):

    .venv/bin/python tools/make_chat_golden.py   # writes tests/fixtures/chat_templates.json
"""

import datetime
import json
from pathlib import Path

from transformers import PreTrainedTokenizerFast

LLAMA3_STYLE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + strftime_now("%d %b %Y") + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

CHATML_DEFAULT_SYSTEM = """{% for message in messages %}
{% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

PHI3_STYLE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\\n' + message['content'] + "
    "'<|end|>\\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)

MISTRAL_STYLE = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- endif %}
{%- endfor %}
"""

NAMESPACE_AND_METHODS = """{%- set ns = namespace(system='', late=false) %}
{%- for m in messages %}
    {%- if m.role != 'system' %}{% continue %}{% endif %}
    {%- set ns.system = m.content.strip() %}
    {%- set ns.late = not loop.first %}
{%- endfor %}
{{- '<meta>' + ({'system': ns.system, 'late': ns.late, 'n': [1, 2.5, none]} | tojson) + '</meta>\\n' }}
{%- for m in messages if m.role != 'system' %}
    {%- if m.content.startswith('!') %}{{ raise_exception('no commands') }}{% endif %}
    {{- '<' + m.role.upper() + '>' + m.content.rstrip() + '</' + m.role + '>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<ASSISTANT>' }}{% endif %}
"""

TEMPLATES = {
    "llama3_style": LLAMA3_STYLE,
    "chatml_default_system": CHATML_DEFAULT_SYSTEM,
    "phi3_style": PHI3_STYLE,
    "mistral_style": MISTRAL_STYLE,
    "namespace_and_methods": NAMESPACE_AND_METHODS,
}

CONVERSATIONS = [
    # An alpaca record as megatrain reads it: instruction, blank line, input.
    [
        {"role": "user", "content": "Translate to French.\n\nGood morning"},
        {"role": "assistant", "content": "Bonjour"},
    ],
    [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another, with \"quotes\" and ünïcödé → 東京?"},
        {"role": "assistant", "content": " 11, \"eleven\"\nor 13. "},
    ],
]

BOS, EOS = "<s>", "</s>"


def counted(render, msgs):
    """The assistant turns' text, cut as chat.rs cuts it."""
    full = render(msgs, False)
    out = []
    for k, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = render(msgs[:k], True)
        through = render(msgs[: k + 1], False)
        assert full.startswith(before)
        if not full.startswith(through):
            assert through.endswith(EOS) and full.startswith(through[: -len(EOS)])
            through = through[: -len(EOS)]
        turn = full[len(before) : len(through)]
        assert m["content"].strip() in turn
        out.append(turn)
    return full, out


def main():
    fixture = Path(__file__).resolve().parent.parent / "crates/zoo/tests/fixtures/tokenizer/tokenizer.json"
    tok = PreTrainedTokenizerFast(tokenizer_file=str(fixture), bos_token=BOS, eos_token=EOS)
    today = datetime.datetime.now().strftime("%d %b %Y")
    cases = []
    for name, source in TEMPLATES.items():
        tok.chat_template = source

        def render(msgs, gen):
            return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

        for msgs in CONVERSATIONS:
            full, turns = counted(render, msgs)
            case = {
                "template": name,
                "messages": msgs,
                "full": full.replace(today, "<DATE>"),
                "counted": [t.replace(today, "<DATE>") for t in turns],
            }
            # The ids transformers gives the conversation (its
            # apply_chat_template(tokenize=True)), by the fixture's BPE;
            # the date's text varies, so only for templates without one.
            if today not in full:
                case["ids"] = tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
            cases.append(case)
    out = Path(__file__).resolve().parent.parent / "tests/fixtures/chat_templates.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    # The tokenizer the ids are of: the BPE fixture with "<s>" and "</s>"
    # added as special tokens.
    tok.chat_template = None
    tdir = out.parent / "chat_tokenizer"
    tok.save_pretrained(tdir)
    for f in tdir.iterdir():
        if f.name != "tokenizer.json":
            f.unlink()
    doc = {"bos_token": BOS, "eos_token": EOS, "templates": TEMPLATES, "cases": cases}
    out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"{out}: {len(cases)} cases")


if __name__ == "__main__":
    main()
