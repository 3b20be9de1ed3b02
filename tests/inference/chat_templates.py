"""The chat templates and conversations tests/inference/test_chat_template.py renders with transformers as the
reference: real-world-style templates written for these tests after the shapes of well-known ones, and
conversations of system, user, assistant and tool turns."""

from __future__ import annotations

from services.inference.chat import ChatMessage
from tests.checkpoints import CHATML_TEMPLATE

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}

# Real-world-style templates, written for these tests after the shapes of well-known ones.
LLAMA3_LIKE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = 'You are a helpful assistant.' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}
{%- for message in messages %}
    {%- if message['role'] == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message['content'] | tojson + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

ZEPHYR_LIKE = """{%- set ns = namespace(found_system=false) %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}{% set ns.found_system = true %}{% endif %}
{%- endfor %}
{%- if not ns.found_system %}
{{- '<|system|>\\nYou are a friendly chatbot.' + eos_token + '\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('Zephyr has no role ' + message['role']) }}
    {%- endif %}
    {{- '<|' + message['role'] + '|>\\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- generation %}{{ message['content'].strip() + eos_token }}{% endgeneration %}
    {%- else %}
        {{- message['content'].strip() + eos_token }}
    {%- endif %}
    {{- '\\n' }}
    {%- if loop.last and add_generation_prompt %}
        {{- '<|assistant|>\\n' }}
    {%- endif %}
{%- endfor %}
"""

# Gemma-like: no system turn of its own (it is folded into the first user turn, skipped with `continue`), the
# assistant is "model", and user and model must alternate.
GEMMA_LIKE = """{{ bos_token }}
{%- set ns = namespace(prefix='', index=0) -%}
{%- for message in messages -%}
    {%- if message['role'] == 'system' -%}
        {%- set ns.prefix = message['content'] | trim + '\\n\\n' -%}
        {%- continue -%}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') != (ns.index % 2 == 1) -%}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (ns.prefix if ns.index == 0 else '') + message['content'] | trim }}
    {{- '<end_of_turn>\\n' -}}
    {%- set ns.index = ns.index + 1 -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

# Block tags on lines of their own, indented: what it renders depends on trim_blocks and lstrip_blocks.
PLAIN = """{% for message in messages %}
  {% if message.role == 'user' %}
User: {{ message.content }}
  {% elif message.role == 'assistant' %}
Assistant: {{ message.content }}
  {% else %}
{{ message.role | capitalize }}{% if message.name %} ({{ message.name }}){% endif %}: {{ message.content }}
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}
Assistant:
{% endif %}
"""

INLINE = {"chatml": CHATML_TEMPLATE, "llama3": LLAMA3_LIKE, "zephyr": ZEPHYR_LIKE, "gemma": GEMMA_LIKE, "plain": PLAIN}

SYSTEM = ChatMessage("system", "  You write short Python.\n")
CONVERSATIONS = {
    "one-turn": [ChatMessage("user", "Reverse a list.")],
    "system-multi-turn": [
        SYSTEM,
        ChatMessage("user", "Reverse a list."),
        ChatMessage("assistant", "def rev(xs):\n    return xs[::-1]\n"),
        ChatMessage("user", "  Now in place, with <b>&</b> and {{ braces }} left alone.  "),
    ],
    "tools": [
        ChatMessage("user", "What is 6 * 7?"),
        ChatMessage("assistant", 'calc("6 * 7")'),
        ChatMessage("tool", '{"result": 42, "note": "<ok> & é 東京"}', name="calc"),
        ChatMessage("tool", "no name"),
        ChatMessage("assistant", "42"),
        ChatMessage("user", "Thanks!"),
    ],
}
# which conversations each inline template accepts (Zephyr has no tool role; Gemma wants user/model alternating)
ACCEPTS = {"zephyr": ("one-turn", "system-multi-turn"), "gemma": ("one-turn", "system-multi-turn")}
