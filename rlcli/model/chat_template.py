"""The chat template of locally built tokenizers (``model.spec.chat_template: chatml``).

ChatML turns as Qwen2.5 writes them (``<|im_start|>role\\n...<|im_end|>\\n``; consecutive ``tool``
messages grouped into one ``user`` turn of ``<tool_response>`` blocks; tool calls are the
assistant's own text, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), with one
difference: the system prompt lists each tool as ``name(argument, ...)`` instead of Qwen's full
JSON schema and instructions. A model built here is trained from scratch on its task and needs
the names, not the prose; the shorter prompt keeps CPU runs fast (the calculator's schema alone
would triple a tool-quickstart trajectory's length).
"""

from __future__ import annotations

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # also the tokenizer's EOS: the engine stops at the end of a turn
# Single tokens the model writes and reads; not special, so decoding keeps them in the text.
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

CHATML = (
    "{%- if tools or messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n' }}{%- endif %}"
    "{%- if tools %}{{- 'Tools:' }}"
    "{%- for tool in tools %}"
    "{%- set function = tool.function if tool.function is defined else tool %}"
    "{{- ' ' + function.name + '(' + (function.parameters.properties | default({}) | list"
    " | join(', ')) + ')' }}"
    "{%- endfor %}{{- '\\n' }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Words the template itself writes: part of the text a built tokenizer is trained on.
TEMPLATE_WORDS = "system\nuser\nassistant\nTools: "
