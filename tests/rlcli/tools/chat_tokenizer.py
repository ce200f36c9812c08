"""A local tokenizer with chat templates that render tool messages (nothing can be downloaded).

A byte-level BPE trained here (``rlcli.model.builder.train_tokenizer``) plus the special tokens of
the two template families the tests use, saved and loaded back with ``AutoTokenizer`` as a run
loads its tokenizer:

- ``QWEN_STYLE``: ChatML as Qwen2.5 writes it: tools in the system prompt, ``<|im_end|>`` and a
  newline after every turn, consecutive ``tool`` messages grouped into one ``user`` turn of
  ``<tool_response>`` blocks.
- ``LLAMA_STYLE``: header tokens and ``<|eot_id|>`` with no newline after it, tool results as
  ``ipython`` turns.
"""

from __future__ import annotations

from pathlib import Path

from rlcli.model.builder import train_tokenizer

QWEN_STYLE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role in ['user', 'system'] or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA_STYLE = (
    "{{- '<|begin_of_text|>' }}"
    "{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nTools:' }}"
    "{%- for tool in tools %}{{- ' ' + tool.function.name }}{%- endfor %}"
    "{{- '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- set role = 'ipython' if message.role == 'tool' else message.role %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

TEMPLATES = {"qwen": QWEN_STYLE, "llama": LLAMA_STYLE}
END_OF_TURN = {"qwen": "<|im_end|>", "llama": "<|eot_id|>"}
_CORPUS = [
    "What is 123 * 456 + 7? I will use the calculator to compute it exactly.",
    "The answer is #### 56095. Let me check: 56088 + 7 = 56095.",
    '{"name": "calculator", "arguments": {"expression": "(12 + 3) * 4"}}',
    "Error: invalid arguments for calculator: 'expression' is a required property",
    "print(sum(range(10)))  # Python code, stdout and stderr",
]


def build_chat_tokenizer(out_dir: Path, family: str = "qwen"):
    """Train, add the family's special tokens and template, save to ``out_dir``, load back."""
    from transformers import AutoTokenizer

    tokenizer = train_tokenizer(_CORPUS * 4, vocab_size=400)
    specials = (
        ["<|im_start|>", "<|im_end|>"]
        if family == "qwen"
        else ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    )
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    if family == "qwen":  # Qwen2.5 has these as added tokens that are not special
        tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tokenizer.chat_template = TEMPLATES[family]
    tokenizer.save_pretrained(out_dir)
    return AutoTokenizer.from_pretrained(out_dir)
