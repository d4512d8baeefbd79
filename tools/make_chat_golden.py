#!/usr/bin/env python3
"""Chat template references for megatrain's `.jsonl` rendering, made with
Hugging Face transformers' own `apply_chat_template`.

For each template below (written for these tests in the shapes of the
families' released templates: a Llama 3 header format with the system
message pulled out and a date line, ChatML with a default system message,
Phi-3's role tags closed by `eos_token`, Mistral's `[INST]` pairs with
`raise_exception` and no generation prompt, one that leans on
`namespace`, loop controls, Python string methods and `tojson`, and
Qwen3's, which drops earlier turns' reasoning) and each conversation, it
writes the text transformers renders for the whole conversation and the
assistant turns' text, cut the way `crates/megatrain/src/data/chat.rs`
documents (renders of the messages before a turn with the generation
prompt, and through it; a trailing `eos_token` only counted where the
conversation ends; one rendering per assistant turn where a template
rewrites earlier turns), and the ids `apply_chat_template(tokenize=True)`
gives with the zoo's BPE fixture. The
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

# Qwen3's arrangement: the reasoning (`<think>...</think>`) of assistant
# turns before the last user message is dropped, and the turns after it
# carry a think block, empty where they had none: each rendering rewrites
# the turns before, so a conversation is cut once per assistant turn.
QWEN3_STYLE = """{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for m in messages %}
    {%- if m.role == 'assistant' %}
        {%- set content = m.content %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

TEMPLATES = {
    "llama3_style": LLAMA3_STYLE,
    "chatml_default_system": CHATML_DEFAULT_SYSTEM,
    "phi3_style": PHI3_STYLE,
    "mistral_style": MISTRAL_STYLE,
    "namespace_and_methods": NAMESPACE_AND_METHODS,
    "qwen3_style": QWEN3_STYLE,
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

# A conversation with reasoning in its replies (Qwen3's template only).
REASONING = [
    [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\n4"},
        {"role": "user", "content": "Times 3?"},
        {"role": "assistant", "content": "<think>\n4 · 3\n</think>\n\n12"},
    ],
]

BOS, EOS = "<s>", "</s>"


def counted(render, msgs):
    """The assistant turns' text, cut as chat.rs cuts it, and the
    conversations rendered (one, or one per assistant turn where the
    template rewrites earlier turns)."""
    full = render(msgs, False)
    out = []
    turns = [k for k, m in enumerate(msgs) if m["role"] == "assistant"]
    for k in turns:
        before = render(msgs[:k], True)
        through = render(msgs[: k + 1], False)
        if not full.startswith(through) and through.endswith(EOS):
            through = through[: -len(EOS)]
        if not (full.startswith(before) and full.startswith(through)):
            break
        turn = full[len(before) : len(through)]
        if msgs[k]["content"].strip() not in turn:
            break
        out.append(turn)
    else:
        return full, out, [msgs]
    # One rendering per assistant turn, only its last turn counted.
    full, out = "", []
    for k in turns:
        before = render(msgs[:k], True)
        through = render(msgs[: k + 1], False)
        assert through.startswith(before)
        turn = through[len(before) :]
        assert msgs[k]["content"].strip().split("</think>")[-1].strip() in turn
        full += through
        out.append(turn)
    return full, out, [msgs[: k + 1] for k in turns]


def main():
    fixture = Path(__file__).resolve().parent.parent / "crates/zoo/tests/fixtures/tokenizer/tokenizer.json"
    tok = PreTrainedTokenizerFast(tokenizer_file=str(fixture), bos_token=BOS, eos_token=EOS)
    today = datetime.datetime.now().strftime("%d %b %Y")
    cases = []
    for name, source in TEMPLATES.items():
        tok.chat_template = source

        def render(msgs, gen):
            return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

        for msgs in CONVERSATIONS + (REASONING if name == "qwen3_style" else []):
            full, turns, renderings = counted(render, msgs)
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
                case["ids"] = [
                    i for r in renderings for i in tok.apply_chat_template(r, tokenize=True, return_dict=False)
                ]
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
