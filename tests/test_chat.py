"""The loss mask: decoding the masked tokens gives exactly the assistant replies plus end-of-turn, nothing else."""

import copy

import pytest

from eyas.data.chat import ChatRenderer
from eyas.data.formats import FormatError

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}],
    [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Good morning"},
     {"role": "assistant", "content": "Bonjour !"}, {"role": "user", "content": "How are you?"},
     {"role": "assistant", "content": "Très bien, merci.\nEt vous ?"}],
    [{"role": "user", "content": "List three primes."}, {"role": "assistant", "content": "2, 3 and 5."},
     {"role": "user", "content": "And their sum?"}, {"role": "assistant", "content": "10"},
     {"role": "user", "content": "Thanks"}],  # a trailing user turn: unmasked
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Yes"},
     {"role": "assistant", "content": "Yes"}, {"role": "user", "content": "Yes"},  # replies equal to prompts
     {"role": "assistant", "content": "Yes"}],
    [{"role": "user", "content": "Write code"}, {"role": "assistant", "content": "```py\nprint('hi')\n```"}],
]

ZEPHYR = ("{% for message in messages %}{% if message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + "
          "eos_token }}{% elif message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + eos_token }}"
          "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' + message['content'] + eos_token }}{% endif %}"
          "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}{% endfor %}")
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def masked_runs(tokenizer, ids, mask):
    """Decoded text of each maximal run of masked tokens."""
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tokenizer.decode(r) for r in runs]


def replies(conv):
    return [m["content"] for m in conv if m["role"] == "assistant"]


@pytest.fixture(scope="module")
def zephyr(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = ZEPHYR
    return tok


@pytest.fixture(scope="module")
def llama3(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = LLAMA3
    return tok


@pytest.fixture(scope="module")
def plain(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = None
    return tok


@pytest.mark.parametrize("conv", CONVERSATIONS)
def test_smollm2_chatml_mask(smollm2_tokenizer, conv):
    tok = smollm2_tokenizer
    enc = ChatRenderer(tok).encode(conv)
    # the ids are those of the target's own template, tokenised once
    assert enc.input_ids == list(tok.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"])
    assert masked_runs(tok, enc.input_ids, enc.loss_mask) == [r + "<|im_end|>" for r in replies(conv)]
    # nothing else: the header and the newline after <|im_end|> stay 0
    text = tok.decode(enc.input_ids)
    assert text.count("<|im_start|>assistant\n") == len(replies(conv))
    assert sum(enc.loss_mask) == sum(len(tok(r + "<|im_end|>", add_special_tokens=False)["input_ids"])
                                     for r in replies(conv))


@pytest.mark.parametrize("conv", CONVERSATIONS)
def test_zephyr_mask(zephyr, conv):
    enc = ChatRenderer(zephyr).encode(conv)
    # Zephyr's generation prompt is "<|assistant|>" without the newline: the model writes "\n" itself
    assert masked_runs(zephyr, enc.input_ids, enc.loss_mask) == ["\n" + r + zephyr.eos_token for r in replies(conv)]


@pytest.mark.parametrize("conv", CONVERSATIONS)
def test_llama3_mask_with_trimmed_replies(llama3, conv):
    padded = [dict(m, content=f"  {m['content']} \n") if m["role"] == "assistant" else m for m in conv]
    r = ChatRenderer(llama3)
    enc = r.encode(padded)  # the template trims replies: the mask covers the trimmed text
    assert masked_runs(llama3, enc.input_ids, enc.loss_mask) == [x + "<|eot_id|>" for x in replies(conv)]
    assert r.stop_token_ids() == [llama3.convert_tokens_to_ids("<|eot_id|>"), llama3.eos_token_id]


@pytest.mark.parametrize("conv", CONVERSATIONS)
def test_plain_text_fallback(plain, conv):
    r = ChatRenderer(plain)
    assert r.fallback
    enc = r.encode(conv)
    assert masked_runs(plain, enc.input_ids, enc.loss_mask) == [" " + x + plain.eos_token for x in replies(conv)]
    assert plain.decode(enc.input_ids).startswith(plain.bos_token)
    i = next(k for k, m in enumerate(conv) if m["role"] == "assistant")
    assert r.render(conv[: i + 1]).endswith(f"Assistant: {conv[i]['content']}{plain.eos_token}\n")
    assert r.render(conv[:i], add_generation_prompt=True).endswith(f"User: {conv[i - 1]['content']}\nAssistant:")


@pytest.mark.parametrize("conv", CONVERSATIONS)
def test_exact_path_agrees_with_fast_path(smollm2_tokenizer, zephyr, llama3, plain, conv, monkeypatch):
    for tok in (smollm2_tokenizer, zephyr, llama3, plain):
        fast = ChatRenderer(tok).encode(conv)
        slow_renderer = ChatRenderer(tok)
        monkeypatch.setattr(slow_renderer, "_spans_by_placeholder", lambda msgs, full: None)
        assert slow_renderer.encode(conv) == fast


def test_prompt_only_has_zero_mask(smollm2_tokenizer):
    enc = ChatRenderer(smollm2_tokenizer).encode([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert len(enc.input_ids) > 0 and sum(enc.loss_mask) == 0


def test_generation_prompt_and_stops(smollm2_tokenizer):
    tok = smollm2_tokenizer
    r = ChatRenderer(tok)
    ids = r.prompt_ids([{"role": "user", "content": "Hi"}])
    assert tok.decode(ids).endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert r.stop_token_ids() == [tok.convert_tokens_to_ids("<|im_end|>")]


def test_template_that_rewrites_replies_is_reported(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] | upper + '\n' }}{% endfor %}"
    with pytest.raises(FormatError) as e:
        ChatRenderer(tok).encode(CONVERSATIONS[0])
    assert e.value.reason == "template-altered-reply"


def test_template_refusing_is_reported(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                         "{{ raise_exception('roles must alternate') }}{% endif %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(FormatError) as e:
        ChatRenderer(tok).encode([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert e.value.reason == "template-error" and "alternate" in e.value.detail
