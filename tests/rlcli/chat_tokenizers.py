"""A locally trained byte-level BPE tokenizer, with or without a chat template, for the reward
model's data tests (nothing is downloaded)."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(chat_template: str | None = None, vocab_size: int = 400):
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["Question: 1 + 2 = ? Answer: #### 3", "What is 2 + 3? It is 5, not 6."]
    raw.train_from_iterator(corpus * 10, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
    tokenizer.chat_template = chat_template
    return tokenizer
